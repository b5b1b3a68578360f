"""Poise: expert-parallel MoE training that stays balanced under skewed, drifting load.

Glossary (used exactly throughout the code):

- *home*: the device that owns an expert's weights and optimizer state.
- *replica*: a copy of an expert's weights on a device other than its home, refreshed from the
  home every step (*Trans*) and whose gradients are reduced back to the home (*Agg*).
- *shadow*: a replica that FasterMoE places on every device (dynamic shadowing).
- *slot*: room for one expert's weights on a device; `slots_per_device` bounds homes + replicas.
- *node*: devices sharing the fast local link; *domain*: nodes sharing a datacentre network.
- *Trans*: the transfer of an expert's current weights from its home to its replicas.
- *Agg*: the reduction of replica gradients back to the home.
- *migration*: a change of home, moving weights and optimizer state.
"""

__version__ = "0.1.0"
