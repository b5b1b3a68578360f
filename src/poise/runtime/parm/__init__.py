"""Parm's MP + EP + ESP MoE layer (`parallel_moe`) and attention + MoE block (`layer`) on its
process groups (`groups`), with tensor parallelism (`tensor_parallel`), expert sharding
(`expert_shard`) and the analytic choice between its two schedules (`choice`)."""
