"""The supervisor's decisions, free of I/O: the node (model.py), the events sources record
(events.py), one pass that turns them into actions (reconcile.py, actions.py), and the rules it
applies: one child lifecycle (lifecycle.py) with what differs by kind (engines.py, engine_health.py,
daemons.py, spawn.py), failover.py, boot.py, shutdown.py, admin.py, adoption.py."""
