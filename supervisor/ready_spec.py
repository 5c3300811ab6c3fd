"""An external daemon's readiness check, as written in the config (``engines.external.daemon_ready``):
what it checks and where. Pure parsing, shared by the schema (supervisor/config.py) and the check itself
(supervisor/effects/ready_checks.py).

    unix:PATH        a Unix socket at PATH accepts a connection (vLLM's daemon binds its socket only
                     once the weights are cached)
    tcp:HOST:PORT    a TCP connection to HOST:PORT is accepted
    http://... (or https://...)  a GET answers 200 (e.g. `vllm preload --weight-cache-health-port`)
    log:REGEX        a line of the daemon's log of this start matches REGEX (SGLang's launcher says
                     "All N weight cache daemons on node K are ready")
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FORMS = "unix:PATH, tcp:HOST:PORT, http://URL, https://URL or log:REGEX"


@dataclass(frozen=True)
class ReadySpec:
    kind: str    # unix | tcp | http | log
    target: str  # the path, "host:port", the URL, or the pattern

    def __str__(self) -> str:
        return self.target if self.kind == "http" else f"{self.kind}:{self.target}"


def parse_ready(spec: str) -> ReadySpec:
    """``spec`` as a ReadySpec; ValueError says what was expected."""
    if spec.startswith(("http://", "https://")):
        return ReadySpec("http", spec)
    kind, sep, target = spec.partition(":")
    if not sep or kind not in ("unix", "tcp", "log") or not target:
        raise ValueError(f"expected {FORMS}, got {spec[:80]!r}")
    if kind == "tcp":
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected tcp:HOST:PORT with a port of 1-65535, got {spec[:80]!r}")
    if kind == "log":
        try:
            re.compile(target)
        except re.error as e:
            raise ValueError(f"expected a regular expression after log:, got {target[:80]!r} ({e})") from None
    return ReadySpec(kind, target)
