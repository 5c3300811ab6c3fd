"""A deterministic engine process (tiny model, bfloat16 on CPU, small step budget so prompts span
chunks, prefix caching on): greedy and seeded requests give the text they give alone under
concurrent load of other requests, a continuation from any chunk under load gives the
uninterrupted text, and /v1/models and /health say the engine is deterministic."""
from __future__ import annotations

import time

import httpx
import pytest

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from harness.load import Load
from test_migration_engine import stream, text_of

MODEL = "tiny-llama0"
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog and then", "A",
           "In the beginning there was a long and winding road that led"]
OTHERS = [{"prompt": f"{w} " * n, "max_tokens": 12 + n, "temperature": t, "seed": n, "ignore_eos": True}
          for n, (w, t) in enumerate([("alpha", 0), ("beta", 0.9), ("gamma delta", 0), ("epsilon", 1.2),
                                      ("zeta eta theta", 0.5), ("iota", 0)], start=3)]


def bodies() -> list[dict]:
    """Each prompt greedy and seeded at temperature 0.8 (top_p 0.95: the nucleus path too)."""
    out = []
    for i, p in enumerate(PROMPTS):
        out.append({"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        out.append({"prompt": p, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 100 + i,
                    "ignore_eos": True})
    return out


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-deterministic")
    cfg = EngineConfig(name="det", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       weight_cache_mode="off", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=32, kv_block_size=8, deterministic=True)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(90)
    yield proc
    proc.stop()


def complete(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_engine_says_it_is_deterministic(engine):
    card = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["deterministic"] is True
    deadline = time.monotonic() + 10
    while "deterministic" not in (health := httpx.get(engine.url + "/health", timeout=10).json()):
        assert time.monotonic() < deadline, health  # the core's stats come with its first heartbeat
        time.sleep(0.1)
    assert health["deterministic"] is True


def test_requests_give_their_solo_text_under_concurrent_load(engine):
    work = bodies()
    want = [complete(engine.url, b) for b in work]  # alone, one at a time
    assert len(set(want)) > len(PROMPTS), "greedy and sampled texts should differ"
    with Load(engine.url, MODEL, threads=3, bodies=OTHERS, stream=True):
        with Load(engine.url, MODEL, threads=4, bodies=work, stream=True) as load:
            while len(load.replies) < 3 * len(work):
                time.sleep(0.2)
    assert not load.failures
    mismatched = [(i, text) for i, text in load.replies if text != want[i]]
    assert not mismatched, f"{len(mismatched)} of {len(load.replies)} replies differ from the solo run"


def test_a_continuation_under_load_gives_the_uninterrupted_text(engine):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0.8, "seed": 7,
            "ignore_eos": True, "return_token_ids": True}
    whole, done = stream(engine.url, "/v1/completions", body)
    assert done
    prompt = whole[0]["choices"][0]["prompt_token_ids"]
    content = [c for c in whole if c["choices"]]
    full = text_of(content, chat=False)
    with Load(engine.url, MODEL, threads=4, bodies=OTHERS, stream=True):
        for k in (1, 5, 11, 17, len(content) - 2):
            sent = [t for c in content[:k] for t in c["choices"][0]["token_ids"]]
            cont, done = stream(engine.url, "/v1/completions", {
                **body, "continuation": {"prompt_token_ids": prompt, "output_token_ids": sent}})
            assert done
            assert text_of(content[:k], chat=False) + text_of(cont, chat=False) == full, f"seam after chunk {k}"
