"""Weight modes `client` (hit and miss) and `daemon`, TP=1 and TP=2, with real daemons and engines."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from daemon.runtime_dir import ensure_private_dir
from wire.engine_config import EngineConfig
from daemon_helpers import start_daemon, wait_daemon_ready
from harness.engine_process import EngineProcess

PROMPT = "The weights came from"


def daemons_of(runtime_dir: Path) -> list[psutil.Process]:
    """Daemon processes serving `runtime_dir` (started by an engine in `daemon` mode)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "daemon" in cmd and str(runtime_dir) in cmd:
            found.append(p)
    return found


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-modes")
    rt = {k: ensure_private_dir(tmp / f"rt-{k}") for k in ("hit", "miss", "own", "tp2", "tp2half")}
    # (runtime dir, rank, tp): tp2half has rank 0's daemon only, so its rank 1 loads from disk
    wanted = [("hit", 0, 1), ("tp2", 0, 2), ("tp2", 1, 2), ("tp2half", 0, 2)]
    daemons = [start_daemon(tiny_model, r, tp, rt[k], tmp / f"daemon-{k}-{r}.log") for k, r, tp in wanted]
    for proc, (k, r, _) in zip(daemons, wanted):
        wait_daemon_ready(proc, rt[k], r, tmp / f"daemon-{k}-{r}.log")
    specs = {"hit": ("client", 1), "miss": ("client", 1), "own": ("daemon", 1), "tp2": ("client", 2),
             "tp2half": ("client", 2)}
    procs = {}
    try:
        for key, (mode, tp) in specs.items():
            cfg = EngineConfig(name=f"m-{key}", model_path=str(tiny_model), port=0, runtime_dir=str(rt[key]),
                               weight_cache_mode=mode, tp_size=tp, max_model_len=256, max_num_seqs=4)
            procs[key] = EngineProcess(cfg, tmp / f"engine-{key}.log")
        for p in procs.values():
            p.wait_ready(120)
        yield procs
    finally:
        for p in procs.values():
            p.signal_group(signal.SIGTERM)
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.stop(10)
        for d in daemons:
            d.wait(10)
        for d in daemons_of(rt["own"]):
            os.killpg(d.pid, signal.SIGTERM)
            d.wait(10)


def generate(proc: EngineProcess, model: str) -> tuple[str, str]:
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    return text, streamed


@pytest.mark.parametrize("key,source", [("hit", "cache_hit"), ("miss", "disk:no_daemon"), ("own", "cache_hit"),
                                        ("tp2", "cache_hit"), ("tp2half", "disk:no_daemon")])
def test_weight_source_and_openai_client(engines, tiny_model, key, source) -> None:
    proc = engines[key]
    assert proc.ready["weights_source"] == source
    startup = httpx.get(proc.url + "/startup").json()
    assert startup["weights_source"] == source and startup["phases"]["weights"] > 0
    text, streamed = generate(proc, tiny_model.name)
    assert text and streamed == text
    # every mode serves the same model: the disk-loaded engine is the reference
    assert text == generate(engines["miss"], tiny_model.name)[0]
    if proc.cfg.tp_size == 2:  # rank 1 reports its own source: a miss there is the engine's miss
        assert f"rank 1 weights: {source}" in proc.log_path.read_text()


def test_daemon_mode_starts_a_detached_daemon(engines) -> None:
    own = daemons_of(Path(engines["own"].cfg.runtime_dir))
    assert len(own) == 1
    assert os.getpgid(own[0].pid) != os.getpgid(engines["own"].pid), "the daemon must not die with the engine"
