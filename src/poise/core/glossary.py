"""Poise's words and letters, defined once and used exactly everywhere else.

Words
-----
- *device*: one accelerator (one rank of the expert-parallel group in a live run).
- *node*: devices behind one network interface, sharing the fast local link (NVLink, PCIe).
- *domain*: nodes sharing one datacentre network; domains meet over wide-area links.
- *expert*: one FFN of a MoE layer; each token picks `top_k` of them.
- *load*: how many token-to-expert assignments a source device sends to each expert in a step,
  `counts[L, D, E]`; a *trace* is a recorded sequence of loads `[S, L, D, E]`.
- *slot*: room for one expert's weights on a device; `slots_per_device` (P) bounds a device's
  homes plus replicas.
- *home*: the device that owns an expert's weights and optimizer state; only it steps the
  optimizer for that expert.
- *replica*: a copy of an expert on a device other than its home. A *shadow* is FasterMoE's
  replica kept on every device.
- *Trans*: sending an expert's current weights from its home to its replicas, every step.
- *Agg*: reducing the replicas' gradients back to the home, every step.
- *migration*: a change of home, moving weights and optimizer state once.
- *placement*: per layer, each expert's home and its copies per device (`Placement`).
- *assignment*: per layer, how a source device's tokens for an expert it does not hold are split
  among that expert's holders (`Assignment`); a holder keeps its own tokens, except that a
  step's split by counts (`Assignment.by_counts`) may have a holder *shed* some of them to the
  other holders to level the loads.
- *plan*: a placement, an assignment, the transfers they need and their predicted cost (`Plan`),
  made by a *policy* (`poise.plan.policies`) from predicted loads.
- *trail*: the plan a rival policy would have in force had it run alone, carried in `auto`'s
  plan so that `auto` can always take the placement that rival reaches (`Plan.trails`).
- *schedule*: how one step's phases overlap (`sync`, `pipelined(n)`, `prophet`, `hybrid`).
- *layout*: a parallel layout, how devices split into pipeline (pp), data (dp), expert (ep) and
  expert-data (edp) parallel groups (SmartMoE's sense, `poise.layouts.pool.Layout`). Nothing
  else is called a layout: where experts live is a placement.
- *step*: one optimizer step; *re-plan*: making a new plan, every `replan_every` steps.

Letters (shapes in docstrings)
------------------------------
S steps, L MoE layers, D devices, E experts, P slots per device, T tokens of one device's
input, K top-k choices per token, M d_model, H d_expert (expert hidden width), R routed rows (the
token-choice rows a device sends or receives), G devices per group (node or domain). Loads are
`[L, D, E]` (source device, then expert); assignment weights are `[L, E, D]` (expert, then
destination device).

A worked example
----------------
One MoE layer, 4 experts on 2 devices with 3 slots each. The static placement gives experts
0-1 to device 0 and 2-3 to device 1; expert 0 is hot:

>>> import numpy as np
>>> from poise.core.placement import Assignment, Placement, transfers_between
>>> from poise.core.spec import ModelSpec
>>> counts = np.array([[[60, 10, 5, 5],      # device 0's tokens for experts 0..3
...                     [40, 10, 5, 5]]])    # device 1's
>>> static = Placement.from_homes(np.array([[0, 0, 1, 1]]), devices=2, slots_per_device=3)
>>> Assignment.even(static).received(static, counts).sum(axis=2)  # tokens computed per device
array([[120.,  20.]])

A plan adds a replica of expert 0 on device 1 (its third slot). Device 1 now keeps its own
40 tokens for expert 0 instead of sending them, and no source is left without a holder:

>>> replicated = static.copy()
>>> replicated.copies[0, 1, 0] = 1
>>> replicated.replicas()[0].astype(int).tolist()    # [D, E]: replicas per device
[[0, 0, 0, 0], [1, 0, 0, 0]]
>>> assignment = Assignment.balanced(replicated, counts)
>>> assignment.received(replicated, counts).sum(axis=2)
array([[80., 60.]])

The busiest device falls from 120 to 80 tokens (max / mean 1.71 -> 1.14). The price: every step
Trans sends expert 0's weights to device 1 and Agg returns its gradient; re-homing nothing, the
plan migrates nothing. With d_model 4, d_expert 8, GELU (2 matrices) and 2-byte weights, an
expert is 2 * 4 * 8 * 2 = 128 bytes:

>>> spec = ModelSpec("example", d_model=4, d_expert=8, experts=4, top_k=2, moe_layers=1)
>>> moves = transfers_between(static, replicated, spec)
>>> moves.trans_bytes.tolist(), moves.agg_bytes.tolist(), moves.migrate_bytes.tolist()
([128.0], [128.0], [0.0])
"""
