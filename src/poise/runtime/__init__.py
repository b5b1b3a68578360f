"""Live balancing on torch.distributed: launching ranks, transfers, the Balancer.

    from poise.runtime import Balancer
    apply_expert_parallel(model, group, num_slots=E // D + 1)        # poise.nn, on every rank
    balancer = Balancer(model, optimizer, policy="auto", replan_every=10)  # then train as usual

- `launch`: `run_ranks(fn, world_size, *args)` on gloo ranks forked from a fork server that
  imported torch once (tests, benchmarks);
- `transfers`: Trans, Agg and migration of one layer's expert slots (`trans`, `agg`,
  `migrate`, their async variants and byte counts); `host_link`: `HostLink`, shared-memory
  channels for them between the CPU ranks of one host;
- `balancer`: `Balancer`, which records loads, plans and applies plans between steps (with
  `plan_inputs`: the modelled cluster, model spec and planning context it plans from; `guard`
  (a candidate priced against the plan in force: `assessment`),
  `selfcal`, `planner`: its adoption rule, self-calibration and background thread; `records`:
  the steps it ran, and the samples the guard judges by; `layer_moves`: routing, Trans, Agg
  and migration on its layers under the plan in force; `probe_steps`: the guard's probe
  steps; `paired_clock`: what the probe steps measure the replicas to save, and what the model
  predicted for it);
- `home_optimizer`: `HomeRowsAdamW`, AdamW stepping only the home rows of expert slots (spare
  slots cost no optimizer work);
- `stats`: `StepStats`, what the Balancer records per step;
- `parallel` (+ `parallel_groups`, `tensor_parallel`, `expert_shard`, `parallel_choice`): Parm's
  MP + EP + ESP MoE layer with its schedules `baseline`, `s1`, `s2` and `auto`;
- `layouts`: SmartMoE layouts at run time (EP groups, expert-data-parallel replicas).

Names are imported lazily, so `poise.runtime.launch` stays cheap to import.
"""

from __future__ import annotations

from poise.util.lazy import lazy_getattr

_EXPORTS = {
    "Balancer": "balancer",
    "PlanMismatchError": "plan_cycle",
    "default_cluster": "balancer",
    "spec_from_layers": "balancer",
    "HomeRowsAdamW": "home_optimizer",
    "home_rows": "home_optimizer",
    "LayerLoads": "stats",
    "StepStats": "stats",
    "layer_loads": "stats",
    "Migration": "moves.transfers",
    "Pending": "moves.transfers",
    "Routes": "moves.transfers",
    "TransferError": "moves.transfers",
    "HostLink": "moves.host_link",
    "agg": "moves.transfers",
    "agg_async": "moves.transfers",
    "migrate": "moves.transfers",
    "trans": "moves.transfers",
    "trans_async": "moves.transfers",
    "RankFailedError": "launch",
    "run_ranks": "launch",
    "ParallelGroups": "parm.groups",
    "check_degrees": "parm.groups",
    "ParallelMoE": "parm.layer",
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
