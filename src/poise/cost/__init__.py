"""What a plan costs on a cluster: where tokens and bytes go (`traffic`), the links as capacities
that carry them (`network`), collectives by their algorithms (`collectives`), the phase times of
one step (`phases`), the cost model and the plan pricer (`model`), the incremental evaluator
policies search with (`incremental`), the host-side costs (`host`), the per-step costs every
policy pays (`step_overheads`) and how phases overlap (`schedule`)."""
