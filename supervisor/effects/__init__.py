"""What acts on the world: the pass's actions carried out (runner.py), each result reported back as
an event: children started and watched (launcher.py, processes.py, pidwatch.py), probed (checks.py,
canary.py), reaped (reaper.py), re-adopted (survey.py); events, metrics and systemd (publisher.py,
bus.py, sdnotify.py); the records file, the control channel, the listening sockets."""
