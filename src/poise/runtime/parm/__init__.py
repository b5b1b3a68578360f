"""Parm's MP + EP + ESP MoE layer (`layer`) on its process groups (`groups`), with tensor
parallelism (`tensor_parallel`), expert sharding (`expert_shard`) and the analytic choice
between its two schedules (`choice`)."""
