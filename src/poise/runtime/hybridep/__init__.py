"""HybridEP in the live runtime: expert domains (`domains`) and compressed migration
(`compress`; the compressed Trans itself is `poise.runtime.moves.compressed_trans`)."""
