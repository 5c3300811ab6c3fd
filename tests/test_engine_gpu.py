"""CUDA paths of the engine (H200): decode through CUDA graphs, an engine process on the GPU, spawn + CUDA."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from engines.bench import graphs_match_eager
from engines.config import EngineConfig
from engines.launch import EngineProcess, wait_for_ready_line
from engines.spawn_client import SpawnClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parent.parent


def test_cuda_graph_decode_gives_eager_tokens(tiny_model) -> None:
    ok, sizes = graphs_match_eager(str(tiny_model), "cuda")
    assert sizes and 1 in sizes and 8 in sizes
    assert ok


def test_engine_on_cuda_serves_with_graphs_and_spawns_after_fork(tiny_model, tmp_path) -> None:
    cfg = EngineConfig(name="gpu", model_path=str(tiny_model), port=0, runtime_dir=str(tmp_path / "rt"),
                       device="cuda", gpu_ids=[0], kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256)
    proc = EngineProcess(cfg, tmp_path / "gpu.log")
    try:
        ready = proc.wait_ready(120)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=tiny_model.name, prompt="Hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        text = client.completions.create(**kw).choices[0].text
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == text
        assert "CUDA graphs: [1, 2, 4, 8]" in (tmp_path / "gpu.log").read_text()
        assert ready["weights_source"] == "disk:off"
    finally:
        assert proc.stop() == 0

    sock, pid = tmp_path / "spawn.sock", None
    server = subprocess.Popen([sys.executable, "-m", "engines.spawn_server", "--socket", str(sock)], cwd=ROOT,
                              stdout=open(tmp_path / "spawn.log", "wb"), stderr=subprocess.STDOUT)
    try:
        while not sock.exists():
            assert server.poll() is None
            time.sleep(0.05)
        with SpawnClient(str(sock)) as spawn:
            pid = spawn.spawn(cfg.model_copy(update={"name": "gpu2"}), str(tmp_path / "gpu2.log"))
            ready = wait_for_ready_line(tmp_path / "gpu2.log", 120, lambda: spawn.wait(pid))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready['port']}/v1", api_key="unused")
            assert client.completions.create(**kw).choices[0].text == text
    finally:
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.terminate()
        server.wait(10)
