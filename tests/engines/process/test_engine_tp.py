"""Tensor parallel on CPU (gloo): TP=2 gives TP=1's tokens; a dying worker rank takes the engine down."""
from __future__ import annotations

import os
import re
import signal
import time

import openai
import psutil
import pytest

from supervisor.effects.processes import group_alive

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess

PROMPTS = ["The quick brown fox", "Hello there", "In a hole in the ground there lived a"]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-tp")
    procs = {}
    for key, tp in ((1, 1), (2, 2), ("2b", 2), ("2c", 2)):
        cfg = EngineConfig(name=f"tp{key}", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                           tp_size=tp, max_model_len=256, max_num_seqs=4)
        procs[key] = EngineProcess(cfg, tmp / f"tp{key}.log")
    try:
        for p in procs.values():
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs.values():
            p.stop(10)


def completions(proc: EngineProcess, model: str, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in PROMPTS:
        kw = dict(model=model, prompt=prompt, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            out.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)))
        else:
            out.append(client.completions.create(**kw).choices[0].text)
    return out


def test_tp2_gives_the_same_greedy_tokens_as_tp1(engines, tiny_model) -> None:
    tp1 = completions(engines[1], tiny_model.name, stream=False)
    assert all(tp1)
    assert completions(engines[2], tiny_model.name, stream=False) == tp1
    assert completions(engines[2], tiny_model.name, stream=True) == tp1


def rank_workers(pid: int) -> list[psutil.Process]:
    """Rank 0's worker ranks, named engine-NAME-rN (its other child is the HTTP front end)."""
    return [p for p in psutil.Process(pid).children() if re.search(r"-r\d+$", p.name())]


def test_tp2_runs_two_ranks_in_one_process_group(engines) -> None:
    rank0 = psutil.Process(engines[2].pid)
    workers = rank_workers(rank0.pid)
    assert len(workers) == 1 and len(rank0.children()) == 2  # rank 1, and the HTTP front end
    assert all(os.getpgid(p.pid) == os.getpgid(rank0.pid) == rank0.pid for p in rank0.children())


def test_sigterm_to_the_group_drains_every_rank_to_exit_0(engines) -> None:
    proc = engines[2]
    worker = rank_workers(proc.pid)[0]
    proc.signal_group(signal.SIGTERM)
    assert proc.proc.wait(30) == 0
    worker.wait(15)
    assert not worker.is_running()
    assert "killing the engine" not in proc.log_path.read_text()


def test_a_dying_worker_rank_kills_the_whole_engine(engines) -> None:
    proc = engines["2b"]
    worker = rank_workers(proc.pid)[0]
    os.kill(worker.pid, signal.SIGKILL)
    assert proc.proc.wait(15) == -signal.SIGKILL
    deadline = time.monotonic() + 5  # the front end too (a zombie until init reaps it does not count)
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_alive(proc.pid)


def test_a_dying_rank_0_takes_its_workers_along(engines) -> None:
    proc = engines["2c"]
    worker = rank_workers(proc.pid)[0]
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.proc.wait(15) == -signal.SIGKILL
    worker.wait(15)  # PR_SET_PDEATHSIG: the kernel kills it when rank 0 goes
    assert not worker.is_running()
