"""Live balancing on torch.distributed: the Balancer and what it runs on, laid out by idea.

    from poise.runtime import Balancer, BalancerConfig
    apply_expert_parallel(model, group, num_slots=E // D + 1)        # poise.nn, on every rank
    balancer = Balancer(model, optimizer, "auto", replan_every=10)   # then train as usual

- `balancer`: the facade (layer hooks, `no_sync`, `reduce_replicas`, `step`, `apply`);
  `config`: `BalancerConfig`, every setting once; `planning`: its planning half;
- `loads`: each step's one-collective gather; `records`: the window of steps it ran; `stats`:
  `StepStats`, what it records per step; `plan_inputs`: the prior cluster and model shape;
- `control/`: the decision, pure NumPy (`controller`, `pricing`, `evidence`, `clock`, `job`);
- `selfcal/`: constants fitted to the run, from one start-up probe; `planner/`: the background
  worker and the leader's broadcast; `probe_steps`: the paired clock's probe steps;
- `moves/`: Trans, Agg, migration, layer moves, host link, transfer group, homes;
- `hybridep/`, `parm/`, `smartmoe`: HybridEP's domains, Parm's MP + EP + ESP layer, SmartMoE's
  layouts at run time; `home_optimizer`: AdamW on home rows; `launch`: local gloo ranks.

The package exports `Balancer` and `BalancerConfig`, imported lazily so that
`poise.runtime.launch` stays cheap to import; everything else comes from its module.
"""

from __future__ import annotations

from poise.util.lazy import lazy_getattr

_EXPORTS = {"Balancer": "balancer", "BalancerConfig": "config"}

__getattr__ = lazy_getattr(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
