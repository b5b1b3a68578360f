"""What moves between the ranks' expert slots: Trans, Agg and migration (`transfers`), their
process group (`transfer_group`) and shared-memory path (`host_link`), carried out on the
layers under the plan in force (`layer_moves`, with each layer's state in `layer_state`), and
which holder of an expert is its home (`homes`)."""
