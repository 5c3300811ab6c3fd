"""`understudy chaos`: load, faults, events and an SLO report against a running supervisor."""
