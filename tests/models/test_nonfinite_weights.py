"""Weights that cannot serve (issue 12 case 3): NaN in the checkpoint is refused at load; finite
weights whose logits overflow fail only the request (OpenAI 500 / SSE error event), never the
engine, and the canary path sees that error."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from wire.engine_config import BOOT_ERROR_EXIT, EngineConfig
from harness.engine_process import EngineProcess, EngineStartError


def corrupt(src, dst, tensor: str, value: float):
    """A copy of checkpoint ``src`` with every value of ``tensor`` set to ``value``."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    tensors[tensor] = torch.full_like(tensors[tensor], value)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def engine_cfg(model, tmp, name: str) -> EngineConfig:
    return EngineConfig(name=name, model_path=str(model), port=0, runtime_dir=str(tmp / f"rt-{name}"),
                        weight_cache_mode="off", max_model_len=128, max_num_seqs=4)


def test_nan_weights_never_serve(tiny_model, tmp_path):
    model = corrupt(tiny_model, tmp_path / "nan-model", "model.norm.weight", float("nan"))
    proc = EngineProcess(engine_cfg(model, tmp_path, "nan"), tmp_path / "nan.log")
    try:
        with pytest.raises(EngineStartError):
            proc.wait_ready(60)
        assert proc.proc.wait(30) == BOOT_ERROR_EXIT
    finally:
        proc.stop()
    log = (tmp_path / "nan.log").read_text()
    assert "model.norm.weight" in log and "NaN or inf" in log, log[-2000:]


def test_overflowing_logits_fail_the_request_not_the_engine(tiny_model, tmp_path):
    model = corrupt(tiny_model, tmp_path / "huge-model", "lm_head.weight", 3e38)  # finite, but logits overflow
    proc = EngineProcess(engine_cfg(model, tmp_path, "huge"), tmp_path / "huge.log")
    try:
        proc.wait_ready(60)
        name = model.name
        for temperature in (0.0, 1.0):  # greedy (the canary's path) and sampled (multinomial raised before)
            r = httpx.post(proc.url + "/v1/completions", timeout=30,
                           json={"model": name, "prompt": "hello", "max_tokens": 4, "temperature": temperature})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "sampling_error" and "non-finite" in err["message"], err
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=30,
                          json={"model": name, "prompt": "hello", "max_tokens": 4, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events and "[DONE]" not in events[-1], events  # the cut stream says so
        assert json.loads(events[-1][6:])["error"]["code"] == "sampling_error"
        from supervisor.effects.canary import run_canary

        from supervisor.router.upstream import Client

        async def canary():
            return await run_canary(Client(timeout_s=30), proc.url, name, "The quick brown fox", 4, 30)
        res = asyncio.run(canary())  # the supervisor never promotes it: a broken model, not "still starting"
        assert not res.ok and res.broken, res
        h = httpx.get(proc.url + "/health", timeout=5)
        assert h.status_code == 200 and proc.proc.poll() is None, h.text
    finally:
        assert proc.stop() == 0


SUP_CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 4, max_model_len: 128}}
failover: {{startup_timeout_s: 60, backoff_base_s: 0.2, backoff_max_s: 1, hold_timeout_s: 1}}
router: {{port: 0}}
admin: {{port: 0}}
"""


def test_supervisor_refuses_nan_checkpoint_at_boot(tiny_model, tmp_path):
    from harness.node import Harness
    model = corrupt(tiny_model, tmp_path / "nan-model", "model.layers.1.mlp.up_proj.weight", float("nan"))
    h = Harness(tmp_path, SUP_CONFIG.format(rt=tmp_path / "rt", model=model))
    try:
        rc = h.proc.wait(120)
    finally:
        h.stop()
    log = h.log.read_text()
    assert rc == 1 and "model.layers.1.mlp.gate_up_proj.weight" in log and "NaN or inf" in log, log[-3000:]


def test_supervisor_never_promotes_an_engine_with_non_finite_logits(tiny_model, tmp_path):
    from harness.node import Harness
    model = corrupt(tiny_model, tmp_path / "huge-model", "lm_head.weight", 3e38)
    h = Harness(tmp_path, SUP_CONFIG.format(rt=tmp_path / "rt", model=model))
    try:
        h.wait_booted()
        st = h.wait_for(lambda st: any("non-finite" in (e.get("reason") or "") for e in st["engines"]), 90,
                        "an engine failed by its canary")
        assert st["primary"] is None and all(e["state"] != "READY" for e in st["engines"]), st
        r = httpx.get(h.router_url + "/readyz", timeout=5)
        assert r.status_code == 503, r.text
        r = httpx.post(h.router_url + "/v1/completions", json={"model": model.name, "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"], r.text  # said, not hung
        assert not list((h.rd / "golden").glob("*.json"))  # no golden answer was recorded from it
        h.check_alive()
    finally:
        h.stop()
