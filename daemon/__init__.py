"""Weight cache daemon: one arena per rank, shared by file descriptor, zero-copy attach.

Engines call `daemon.client.attach_or_load(...)` with a `daemon.fingerprint.make_cache_config(...)`;
the supervisor runs `python -m daemon ...` (daemon.cli.main) per rank; checkpoints are read by
`daemon.loader.load_checkpoint_into`. See docs/CONTRACTS.md.
"""
