"""`understudy bench failover --streams` refuses streams that cannot fit the node's context before it
starts a node (a second operator's review: on the default tiny model its default lengths, up to 2,048
tokens against max_model_len 512, made 4,377 of 4,628 requests fail and printed figures anyway)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_streams_longer_than_the_nodes_context_are_refused_before_any_node_starts() -> None:
    r = subprocess.run([sys.executable, "-m", "supervisor", "bench", "failover", "--streams", "8", "--runs", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("--input-len up to 1024 + --output-len up to 1024 = 2048 tokens exceeds engines.max_model_len 512"
            in r.stderr), r.stderr
