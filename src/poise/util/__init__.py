"""Small helpers with no knowledge of MoE: atomic writes (`atomic`), heap settings (`heap`) and
lazy package exports (`lazy`)."""
