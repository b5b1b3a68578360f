"""The simulator: replays routing traces on modelled clusters with every policy."""
