"""Poise: expert-parallel MoE training that stays balanced under skewed, drifting load.

The words Poise uses (home, replica, slot, Trans, Agg, placement, assignment, plan, layout,
trail, ...) and the letters of its shapes are defined once, with a worked example, in
`poise.core.glossary`. The package map is in the README's "Architecture" section and in
docs/architecture.md.
"""

__version__ = "0.1.0"
