"""The roles a node plays, put together from the floors below: the coordinator (plans, instances, acks), the stage host (plan -> shard -> runner) and the model fetched from peers."""
