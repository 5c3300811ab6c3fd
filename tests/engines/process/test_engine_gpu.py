"""CUDA paths of the engine (H200): decode through CUDA graphs, an engine process on the GPU, spawn + CUDA."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from daemon.loader import load_checkpoint_into
from harness.bench.decode import fused_as_accurate, fused_logit_error, graphs_match_eager
from wire.engine_config import EngineConfig
from models import build_model, read_model_args
from engines.core.runner import ModelRunner
from harness.engine_process import EngineProcess, all_graphs_line, wait_for_ready_line
from engines.process.spawn_client import SpawnClient

def complete(base_url: str, stream: bool = False, **body) -> str:
    """One completion over plain HTTP (the GPU image has no `openai` package; CPU tests use it)."""
    if not stream:
        reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16 also runs the fused decode kernels
def test_cuda_graph_decode_gives_eager_tokens(tiny_model, dtype) -> None:
    same, sizes = graphs_match_eager(str(tiny_model), "cuda", dtype)
    assert 1 in sizes["decode"] and 8 in sizes["decode"] and 64 in sizes["mixed"]
    assert same == {"torch": True, "fused": True}


def test_fused_decode_kernels_are_as_accurate_as_the_torch_path(tiny_model) -> None:
    err = fused_logit_error(str(tiny_model), "cuda", "bfloat16")
    assert "skipped" not in err, err
    assert fused_as_accurate(err), err
    assert err["fused_argmax_agreement"] >= err["torch_argmax_agreement"] - 0.05, err


def test_engine_on_cuda_serves_with_graphs_and_spawns_after_fork(tiny_model, tmp_path) -> None:
    cfg = EngineConfig(name="gpu", model_path=str(tiny_model), port=0, runtime_dir=str(tmp_path / "rt"),
                       device="cuda", gpu_ids=[0], kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256)
    proc = EngineProcess(cfg, tmp_path / "gpu.log")
    try:
        ready = proc.wait_ready(120, all_graphs=False)
        kw = dict(model=tiny_model.name, prompt="Hello", max_tokens=16, temperature=0, ignore_eos=True)
        assert complete(proc.url, **kw)  # (ready with the largest graphs: a step then may pad to them)
        log = (tmp_path / "gpu.log").read_text()
        assert "CUDA graphs: {'decode': [8], 'mixed': [" in log and "more when the engine has time" in log
        assert "{'decode': [1, 2, 4, 8], 'mixed': [64, " in all_graphs_line(tmp_path / "gpu.log")
        text = complete(proc.url, **kw)
        assert complete(proc.url, stream=True, **kw) == text
        assert ready["weights_source"] == "disk:off"
    finally:
        assert proc.stop() == 0

    sock, pid = tmp_path / "spawn.sock", None
    server = subprocess.Popen([sys.executable, "-m", "engines.process.spawn_server", "--socket", str(sock)], cwd=ROOT,
                              stdout=open(tmp_path / "spawn.log", "wb"), stderr=subprocess.STDOUT)
    try:
        while not sock.exists():
            assert server.poll() is None
            time.sleep(0.05)
        with SpawnClient(str(sock)) as spawn:
            pid = spawn.spawn(cfg.model_copy(update={"name": "gpu2"}), str(tmp_path / "gpu2.log"))
            ready = wait_for_ready_line(tmp_path / "gpu2.log", 120, lambda: spawn.wait(pid))
            assert complete(f"http://127.0.0.1:{ready['port']}", **kw) == text
    finally:
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.terminate()
        server.wait(10)


def test_first_use_warm_up_replays_only_padding_and_keeps_the_tokens(tiny_model, tmp_path) -> None:
    """UNDERSTUDY_WARM_FIRST_USE=sampling,graphs: every captured graph replayed once on padding rows
    and a full batch's draw at startup; the engine then serves the tokens an engine without it gives
    (a replay that wrote into a real block or broke a graph would change them)."""
    cfg = EngineConfig(name="warm", model_path=str(tiny_model), port=0, runtime_dir=str(tmp_path / "rt"),
                       device="cuda", gpu_ids=[0], kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256)
    kw = dict(model=tiny_model.name, prompt="Hello", max_tokens=24, temperature=0, ignore_eos=True)
    texts = []
    for name, warm in (("plain", ""), ("warm", "sampling,graphs")):
        proc = EngineProcess(cfg.model_copy(update={"name": name}), tmp_path / f"{name}.log",
                             env={"UNDERSTUDY_WARM_FIRST_USE": warm})
        try:
            proc.wait_ready(120)
            texts.append([complete(proc.url, **kw), complete(proc.url, **{**kw, "temperature": 0.8, "seed": 7})])
        finally:
            assert proc.stop() == 0
    assert "warmed sampling, graphs in" in (tmp_path / "warm.log").read_text()
    assert "warmed" not in (tmp_path / "plain.log").read_text()
    assert texts[0] == texts[1] and texts[0][0]


def test_engine_in_client_mode_serves_from_the_daemons_read_only_cuda_arena_through_graphs(tiny_model,
                                                                                          tmp_path) -> None:
    """The supervisor's way on a GPU: a daemon holds the weights in a CUDA VMM arena, an engine in
    `client` mode maps it (read-only: harness/gpu_check.py shows a write through such a mapping is
    refused), captures its CUDA graphs over it and serves the same tokens as an engine that loaded
    the same checkpoint from disk."""
    from daemon import framing
    from daemon.cli import daemon_argv
    from daemon.runtime_dir import daemon_socket_path
    rt = tmp_path / "rt"
    sock = daemon_socket_path(rt, 0)
    daemon = subprocess.Popen(daemon_argv(tiny_model, 0, 1, "cuda", "float32", rt, 0), cwd=ROOT,
                              stdout=open(tmp_path / "daemon.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        info: dict = {}
        while info.get("state") != "ready":
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()[-2000:]
            try:
                info = framing.request(sock, {"op": "status"}, 5.0)["daemon"]
            except OSError:
                time.sleep(0.1)
        assert info["weights_finite"] is True and info["resident_bytes"] > 0
        base = dict(model_path=str(tiny_model), port=0, runtime_dir=str(rt), device="cuda", gpu_ids=[0],
                    kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256, cuda_graphs=True)
        kw = dict(model=tiny_model.name, prompt="Hello", max_tokens=16, temperature=0, ignore_eos=True)
        client = EngineProcess(EngineConfig(name="client", weight_cache_mode="client", **base), tmp_path / "client.log")
        try:
            ready = client.wait_ready(120)
            assert ready["weights_source"] == "cache_hit", ready
            assert "{'decode': [1, 2, 4, 8], 'mixed': [64, " in all_graphs_line(tmp_path / "client.log")
            text = complete(client.url, **kw)
            assert complete(client.url, stream=True, **kw) == text and text
            assert framing.request(sock, {"op": "status"}, 5.0)["daemon"]["attaches"] >= 1
        finally:
            assert client.stop() == 0
        disk = EngineProcess(EngineConfig(name="disk", weight_cache_mode="off", **base), tmp_path / "disk.log")
        try:
            assert disk.wait_ready(120)["weights_source"] == "disk:off"
            assert complete(disk.url, **kw) == text  # the arena holds exactly what a disk load gives
        finally:
            assert disk.stop() == 0
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_block_copies_on_cuda_ask_torchs_allocator_for_nothing(tiny_model) -> None:
    """A failover's tail copies (up to max_num_seqs blocks a step, engines/core/tail_publisher.py) go through the
    runner's kept buffer: torch's allocator holds no more device memory after them. (A temporary for
    the copy grew it by a 20 MiB segment in a new primary's first large step, whose schedule phase
    stalled: bench/RESULTS.md, twenty-second session.)"""
    model = build_model(read_model_args(tiny_model), device="meta")
    model.to_empty(device="cuda")
    load_checkpoint_into(model, tiny_model)
    runner = ModelRunner(model, torch.device("cuda"))
    runner.allocate_kv_cache(1 << 26, 16, 128, 64, 256)
    kv = runner.model.kv_cache
    for layer in kv:
        layer.copy_(torch.randn_like(layer))
    old = kv[0][:, 1:64].clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    runner.copy_blocks([(i, 64 + i) for i in range(1, 64)])
    torch.cuda.synchronize()
    assert torch.equal(kv[0][:, 65:128], old)
    assert torch.cuda.memory_reserved() - before <= 0
