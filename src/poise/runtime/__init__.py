"""Live balancing on torch.distributed: launching ranks, transfers, the Balancer."""
