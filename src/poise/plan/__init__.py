"""The planner: load prediction (`predict`), the balancing policies, one module each, in one
registry (`policies`), plan files (`files`) and EPLB's arrays in and out (`eplb_format`)."""
