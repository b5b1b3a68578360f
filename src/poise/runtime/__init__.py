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

Names are imported lazily, so `poise.runtime.launch` stays cheap to import.
"""

from __future__ import annotations

from poise.util.lazy import lazy_getattr

_EXPORTS = {
    "Balancer": "balancer",
    "BalancerConfig": "config",
    "PlanMismatchError": "planning",
    "default_cluster": "balancer",
    "spec_from_layers": "balancer",
    "HomeRowsAdamW": "home_optimizer",
    "home_rows": "home_optimizer",
    "LayerLoads": "stats",
    "StepStats": "stats",
    "layer_loads": "stats",
    "Migration": "moves.transfers",
    "Pending": "moves.exchange",
    "Routes": "moves.exchange",
    "TransferError": "moves.exchange",
    "HostLink": "moves.host_link",
    "agg_async": "moves.transfers",
    "migrate": "moves.transfers",
    "trans": "moves.transfers",
    "trans_async": "moves.transfers",
    "RankFailedError": "launch",
    "run_ranks": "launch",
    "ParallelGroups": "parm.groups",
    "check_degrees": "parm.groups",
    "ParallelMoE": "parm.parallel_moe",
    "parallel_block": "parm.layer",
    "load_full_state": "parm.layer",
    "full_state": "parm.layer",
    "sync_parallel_grads": "parm.layer",
    "ParmChooser": "parm.choice",
    "ParmShape": "parm.choice",
    "LayoutGroups": "smartmoe",
    "create_groups": "smartmoe",
    "all_reduce_expert_grads": "smartmoe",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
