"""A stage of the ring: a layer range of any mlx-lm model (shard), its sessions and batched caches, sampling and grammar masks, the compute thread."""
