"""The benchmarks (`understudy bench ...`): the weight path, the engine, a node under failover, supervisor
restarts and live serving."""
