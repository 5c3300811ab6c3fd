"""Engines over a daemon's shared KV pool, with real processes and signals (CPU, fp32): a parked
standby allocates no KV, promotion adopts the pool, a continuation after a SIGKILL mid-step reuses
every sealed block and is token for token the uninterrupted answer, a demotion hands streams off,
the prefix cache survives the engine, and a pool of other weights or a corrupt index is refused.

The test plays the supervisor: it binds the control endpoint (a zmq ROUTER) and sends the commands."""
from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable

import httpx
import psutil
import pytest
import torch

from daemon.framing import recv_frame, send_frame
from daemon.kv_index import SEALED, BlockIndex
from daemon.kv_layout import KVLayout
from daemon.runtime_dir import daemon_socket_path, ensure_private_dir
from wire.engine_config import EngineConfig
from daemon_helpers import start_daemon, wait_daemon_ready
from harness.engine_process import EngineProcess
from tests.engines.process.test_engine_control import Router

POOL_BYTES = 8 << 20
BS = 16


class Node:
    """A daemon with a KV pool per rank, engines started on them in turn, and the control endpoint."""

    def __init__(self, model, tmp, tp: int = 1, device: str = "cpu") -> None:
        self.model, self.tmp, self.tp, self.device = model, tmp, tp, device
        self.rt = ensure_private_dir(tmp / "rt")
        self.control = f"ipc://{tmp}/control.sock"
        self.router = Router(self.control)
        self.daemons = []
        for rank in range(tp):
            log = tmp / f"daemon-{rank}.log"
            self.daemons.append(start_daemon(model, rank, tp, self.rt, log,
                                             ["--kv-pool-bytes", str(POOL_BYTES), "--kv-slots", "3",
                                              "--device", device]))
            wait_daemon_ready(self.daemons[-1], self.rt, rank, log)
        self.engines: list[EngineProcess] = []

    def engine(self, name: str, slot: int, model=None, incarnation: int = 1, kv_tails: bool = True) -> EngineProcess:
        """An engine on the pools (parked); as the writer it names its tails unless `kv_tails` is off."""
        cfg = EngineConfig(name=name, model_path=str(model or self.model), port=0, runtime_dir=str(self.rt),
                           tp_size=self.tp, weight_cache_mode="client", shared_kv=True, kv_slot=slot, kv_block_size=BS,
                           kv_tails=kv_tails,
                           kv_cache_bytes=2 << 30,  # what an engine of its own would take: never allocated here
                           control_endpoint=self.control, incarnation=incarnation, heartbeat_interval_s=0.1,
                           max_model_len=1024, max_num_seqs=4, device=self.device,
                           gpu_ids=[0] if self.device == "cuda" else [])
        proc = EngineProcess(cfg, self.tmp / f"{name}-{incarnation}.log")
        self.engines.append(proc)
        proc.wait_ready(120)
        return proc

    def command(self, proc: EngineProcess, cmd: str, reply: str | None) -> dict | None:
        ident = f"{proc.cfg.name}:{proc.cfg.incarnation}"
        self.router.msgs.clear()
        self.router.command(ident.encode(), {"cmd": cmd})
        if reply is None:
            return None
        return self.router.wait_for(lambda m: m["type"] in (reply, f"{cmd}_failed") and m["engine"] == proc.cfg.name)

    def heartbeat(self, proc: EngineProcess, pred=lambda m: True) -> dict:  # noqa: ANN001
        self.router.msgs.clear()
        return self.router.wait_for(lambda m: m["type"] == "heartbeat" and m["engine"] == proc.cfg.name and pred(m))

    def close(self) -> None:
        for p in self.engines:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.stop(10)
        for d in self.daemons:
            d.send_signal(signal.SIGTERM)
            d.wait(10)


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    n = Node(tiny_model, tmp_path_factory.mktemp("shared-kv"))
    try:
        yield n
    finally:
        n.close()


def complete(proc: EngineProcess, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(proc.url + "/v1/completions", json={"model": model_name(proc), **body}, timeout=timeout)


def model_name(proc: EngineProcess) -> str:
    return os.path.basename(proc.cfg.model_path)


LONG = {"prompt": "one two three four five six seven eight nine ten " * 4, "max_tokens": 300, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


def kill(proc: EngineProcess) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.proc.wait(10)


def test_a_parked_standby_allocates_no_kv_and_serves_only_its_canary(node: Node) -> None:
    a = node.engine("a", 0)
    assert a.ready["kv_source"] == "shared"
    hb = node.heartbeat(a)
    assert hb["kv_mode"] == "parked" and hb["kv_blocks_total"] == 512 // BS  # its scratch slot
    assert psutil.Process(a.pid).memory_info().rss < 1 << 30  # kv_cache_bytes (2 GiB) was never taken
    r = complete(a, {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    big = complete(a, {"prompt": "hello", "max_tokens": 600})
    assert big.status_code == 503 and big.json()["error"]["code"] == "parked"


def test_promotion_adopts_the_pool_and_the_prefix_cache_outlives_the_engine(node: Node) -> None:
    a = node.engines[0]
    adopted = node.command(a, "promote", "adopted")
    assert adopted["type"] == "adopted" and adopted["kv_mode"] == "writer" and adopted["index_reset"] is None
    # the role's answer came first, with nothing read yet: the node routes to the engine as it reads the pool
    answers = [m for _, m in node.router.msgs if m["engine"] == "a" and m["type"] in ("promoted", "adopted")]
    assert [m["type"] for m in answers] == ["promoted", "adopted"] and "adopted_blocks" not in answers[0]
    assert answers[0]["pool_epoch"] == adopted["pool_epoch"]
    assert node.heartbeat(a)["kv_mode"] == "writer"
    first = complete(a, LONG).json()["choices"][0]
    kill(a)  # the engine goes; its blocks stay in the daemon's pool
    b = node.engine("b", 1)
    promoted = node.command(b, "promote", "adopted")
    assert promoted["adopted_blocks"] >= (len(first["prompt_token_ids"]) + 300) // BS - 1
    again = complete(b, LONG).json()
    assert again["choices"][0]["token_ids"] == first["token_ids"]
    metrics = httpx.get(b.url + "/metrics").text
    hits = next(float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("understudy_prefix_cache_hit_tokens_total"))
    assert hits >= len(first["prompt_token_ids"]) // BS * BS  # b never computed this prompt


def stream_then_kill(proc: EngineProcess, body: dict, after: int,
                     then: Callable[[EngineProcess], object] = kill) -> tuple[list[int], list[int]]:
    """Stream `body` from `proc` and SIGKILL it once `after` tokens came, mid-sequence (its last
    block being written): the prompt's ids and the tokens the client got. `then`: do that instead
    of the kill, and read on to the end of the stream."""
    ids: list[int] = []
    prompt: list[int] = []
    done = False
    with httpx.stream("POST", proc.url + "/v1/completions", json={"model": model_name(proc), **body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                prompt = prompt or c.get("prompt_token_ids") or []
                ids += c.get("token_ids") or []
                if len(ids) >= after and not done:
                    then(proc)
                    done = True
                    if then is kill:
                        break
    return prompt, ids


def continued(node: Node, proc: EngineProcess, body: dict, prompt: list[int], ids: list[int]) -> list[list[int]]:
    """Continue the stream on `proc` from the tokens its client got, check that the text is the
    uninterrupted answer, and return what `proc` reported of it: [[reused, recomputed]]."""
    cont = complete(proc, {**body, "continuation": {"prompt_token_ids": prompt, "output_token_ids": ids}})
    assert cont.status_code == 200, cont.text
    report = node.router.wait_for(lambda m: m["type"] == "continuations" and m["engine"] == proc.cfg.name)
    assert ids + cont.json()["choices"][0]["token_ids"] == complete(proc, body).json()["choices"][0]["token_ids"]
    return report["each"]


def test_a_continuation_after_a_sigkill_mid_step_is_exact_and_recomputes_one_token(node: Node) -> None:
    b = node.engines[-1]
    # 900 tokens, killed at 40: still generating then, however far the client lags (at 300 a loaded
    # machine's reader fell behind its end once: nothing unfinished was left to quarantine)
    body = {**LONG, "prompt": LONG["prompt"] + "twelve", "max_tokens": 900}
    prompt, ids = stream_then_kill(b, body, 40)
    c = node.engine("c", 2)
    promoted = node.command(c, "promote", "adopted")
    assert promoted["quarantined_blocks"] >= 1  # the dead writer's unfinished blocks are not reused
    # As at a failover, the continuation comes while those blocks are quarantined (the dead writer's
    # last kernels may still write them): its tail is copied out of one, never written in place.
    cont = complete(c, {**body, "continuation": {"prompt_token_ids": prompt, "output_token_ids": ids}})
    assert cont.status_code == 200, cont.text
    report = node.router.wait_for(lambda m: m["type"] == "continuations" and m["engine"] == "c")
    assert report["each"] == [[len(prompt) + len(ids) - 1, 1]]  # (one step's: [reused, recomputed] each)
    node.command(c, "fenced", None)  # (the test knows b's process group is gone)
    assert node.heartbeat(c, lambda m: m["kv_quarantined_blocks"] == 0)["kv_mode"] == "writer"
    whole = complete(c, body).json()["choices"][0]["token_ids"]
    assert len(ids) >= 40 and ids + cont.json()["choices"][0]["token_ids"] == whole  # the uninterrupted answer
    hb = node.heartbeat(c, lambda m: m["continuations"] >= 1)
    assert hb["continuation_recomputed_tokens"] == 1  # the last partial block came from the dead writer's tail


def test_demotion_hands_streams_off_and_parks(node: Node) -> None:
    c = node.engines[-1]
    with httpx.stream("POST", c.url + "/v1/completions", json={"model": model_name(c), **LONG, "stream": True},
                      timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                demoted = node.command(c, "demote", "demoted")
                assert demoted["handed_off"] >= 1
        assert "data: [DONE]" not in lines and any(ln.startswith(": handed off") for ln in lines)
    assert node.heartbeat(c)["kv_mode"] == "parked"
    assert node.command(c, "promote", "adopted")["adopted_blocks"] > 0  # its own sealed blocks, back


def test_a_pool_of_other_weights_is_refused(node: Node, make_tiny) -> None:
    other = node.engine("x", 1, model=make_tiny(seed=7))
    assert other.ready["weights_source"] == "disk:mismatch" and other.ready["kv_source"] == "own:mismatch"
    kill(other)


def test_a_corrupt_index_is_rejected_and_the_pool_starts_empty(node: Node) -> None:
    c = node.engines[-2] if node.engines[-1].cfg.name == "x" else node.engines[-1]
    node.command(c, "demote", "demoted")
    with socket.socket(socket.AF_UNIX) as s:  # the index, as any engine of the rank gets it
        s.connect(str(daemon_socket_path(node.rt, 0)))
        send_frame(s, {"op": "kv_attach", "fingerprint": json.loads(_fingerprint(node))})
        reply, fds = recv_frame(s)
    index = BlockIndex(fds[1], reply["kv_pool"]["index_bytes"], KVLayout(**reply["kv_pool"]["layout"]))
    sealed = [b for b in range(len(index.entries)) if int(index.entries[b]["word"]) & 0xFFFFFFFF == SEALED]
    assert sealed
    index.entries[sealed[0]]["key_lo"] ^= 1  # a SEALED block no writer wrote
    promoted = node.command(c, "promote", "adopted")
    assert "bad checksum" in promoted["index_reset"] and promoted["adopted_blocks"] == 0
    assert "KV index rejected" in c.log_path.read_text()
    assert complete(c, {"prompt": "still serving", "max_tokens": 4}).status_code == 200
    for fd in fds:
        os.close(fd)


def _fingerprint(node: Node) -> str:
    from daemon.fingerprint import make_cache_config
    return make_cache_config(str(node.model)).model_dump_json()


def test_without_tails_a_continuation_after_a_sigkill_recomputes_its_last_partial_block_and_is_exact(
        tiny_model, tmp_path) -> None:
    """kv_tails off (the default): the dead writer named no tail, so a continuation reuses every full
    block of its prompt and the tokens sent, and recomputes the rest: at most one block's worth."""
    node = Node(tiny_model, tmp_path)
    try:
        a = node.engine("a", 0, kv_tails=False)
        node.command(a, "promote", "adopted")
        body = {**LONG, "max_tokens": 900}
        prompt, ids = stream_then_kill(a, body, 40)
        b = node.engine("b", 1)
        assert node.command(b, "promote", "adopted")["tails"] == 0
        reused = (len(prompt) + len(ids) - 1) // BS * BS  # every full block
        assert continued(node, b, body, prompt, ids) == [[reused, len(prompt) + len(ids) - reused]]
    finally:
        node.close()


def test_a_planned_handoff_names_every_tail_so_its_continuation_recomputes_one_token(tiny_model, tmp_path) -> None:
    """kv_tails off: a demotion still names each handed-off stream's tail (every step it launched has
    completed), so the next writer continues the stream recomputing one token, and exactly."""
    node = Node(tiny_model, tmp_path)
    try:
        a, b = node.engine("a", 0, kv_tails=False), node.engine("b", 1, kv_tails=False)
        node.command(a, "promote", "adopted")
        body = {**LONG, "max_tokens": 900}
        demoted = []
        prompt, ids = stream_then_kill(a, body, 40, lambda proc: demoted.append(node.command(proc, "demote", "demoted")))
        assert demoted[0]["handed_off"] == 1 and demoted[0]["tails"] == 1
        assert node.command(b, "promote", "adopted")["tails"] >= 1
        assert continued(node, b, body, prompt, ids) == [[len(prompt) + len(ids) - 1, 1]]
    finally:
        node.close()


def test_tensor_parallel_engines_share_one_pool_per_rank(tiny_model, tmp_path) -> None:
    """TP=2: each rank maps its own daemon's pool, rank 0 writes the index for both; a continuation
    after a SIGKILL of the writer mid-stream reuses the blocks on every rank (its tail copied on
    each) and is the uninterrupted answer."""
    node = Node(tiny_model, tmp_path, tp=2)
    try:
        a, b = node.engine("a", 0), node.engine("b", 1)
        assert a.ready["kv_source"] == b.ready["kv_source"] == "shared"
        node.command(a, "promote", "adopted")
        body = {**LONG, "max_tokens": 900}
        prompt, ids = stream_then_kill(a, body, 50)
        assert node.command(b, "promote", "adopted")["adopted_blocks"] > 0
        cont = complete(b, {**body, "continuation": {"prompt_token_ids": prompt, "output_token_ids": ids}})
        whole = complete(b, body).json()["choices"][0]["token_ids"]
        assert ids + cont.json()["choices"][0]["token_ids"] == whole
        assert node.heartbeat(b, lambda m: m["continuations"] >= 1)["continuation_recomputed_tokens"] == 1
    finally:
        node.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_continuation_copies_the_dead_writers_tail_and_is_exact(tiny_model, tmp_path) -> None:
    """The same SIGKILL mid-stream on a GPU: the pool in a CUDA VMM allocation, the tail copied by
    the runner's block copy while the dead writer's blocks are quarantined, CUDA graphs on."""
    node = Node(tiny_model, tmp_path, device="cuda")
    try:
        a = node.engine("a", 0)
        node.command(a, "promote", "adopted")
        body = {**LONG, "max_tokens": 900}
        prompt, ids = stream_then_kill(a, body, 40)
        b = node.engine("b", 1)
        assert node.command(b, "promote", "adopted")["quarantined_blocks"] >= 1
        assert continued(node, b, body, prompt, ids) == [[len(prompt) + len(ids) - 1, 1]]
    finally:
        node.close()
