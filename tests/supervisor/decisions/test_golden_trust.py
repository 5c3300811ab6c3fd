"""GoldenStore: a golden answer from an unchecked load, or for other bytes, gives way to one recorded
from weights checked finite; a checked one is never replaced by an unchecked one."""
from __future__ import annotations

from supervisor.effects.canary import CanaryResult, GoldenStore

CHECKED = {"weights_finite": True, "content_digest": "d1", "weights_source": "cache_hit"}


def test_golden_trust_rules(tmp_path):
    store = GoldenStore(tmp_path)
    garbage, good = CanaryResult(True, text="zz", token_ids=[1]), CanaryResult(True, text="ok", token_ids=[2])
    assert store.record("k", garbage, "a", {"weights_finite": None})["token_ids"] == [1]  # unchecked: provisional
    assert store.record("k", good, "b", CHECKED)["token_ids"] == [2]  # a checked load supersedes it
    assert store.record("k", garbage, "c", {"weights_finite": None})["token_ids"] == [2]  # never the reverse
    assert store.record("k", garbage, "d", CHECKED)["token_ids"] == [2]  # same bytes: the first checked stays
    other = {**CHECKED, "content_digest": "d2"}  # other bytes under the same stat key
    assert store.record("k", garbage, "e", other)["token_ids"] == [1]
    assert store.get("k")["recorded_by"] == "e"
