"""The expert-parallel MoE layer: router, experts, dispatcher, slots (torch)."""
