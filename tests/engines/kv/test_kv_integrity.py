"""KV integrity (engines/kv/integrity.py): noise written over a sealed block's keys and values in the
daemon's shared pool is never served. Real processes (a daemon, engines, SIGKILL), CPU, fp32: the
next prefix hit on the same writer, and the adoption by a new writer after a failover, recompute
the changed blocks and answer exactly what the untouched pool answered; the counters move and the
log names the blocks."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from daemon.framing import recv_frame, send_frame
from daemon.kv_index import SEALED, BlockIndex
from daemon.kv_layout import KVLayout
from daemon.runtime_dir import daemon_socket_path
from daemon.transport_cpu import map_shared
from engines.kv.integrity import block_digests, _weights
from test_shared_kv_engine import LONG, Node, _fingerprint, complete, kill

BODY = {**LONG, "max_tokens": 24}


class Pool:
    """The rank's pool and index, mapped as any engine of the rank maps them (the node's uid)."""

    def __init__(self, node: Node) -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(daemon_socket_path(node.rt, 0)))
            send_frame(s, {"op": "kv_attach", "fingerprint": json.loads(_fingerprint(node))})
            reply, self.fds = recv_frame(s)
        self.layout = KVLayout(**reply["kv_pool"]["layout"])
        self.index = BlockIndex(self.fds[1], reply["kv_pool"]["index_bytes"], self.layout)
        region, self._map = map_shared(self.fds[0], self.layout.pool_bytes)
        self.kv = region[:self.layout.pool_bytes].view(torch.float32).view(self.layout.shape)

    def digested(self) -> list[int]:
        """The SEALED blocks whose digests are stored."""
        e = self.index.entries
        return [b for b in range(len(e)) if int(e[b]["word"]) & 0xFFFFFFFF == SEALED and int(e[b]["digest"])]

    def scribble(self, blocks: list[int]) -> None:
        """Noise over every layer's keys and values of `blocks` (as a stray writer would leave them)."""
        g = torch.Generator().manual_seed(1)
        for b in blocks:
            self.kv[:, :, b] += torch.randn(self.kv[:, :, b].shape, generator=g)

    def close(self) -> None:
        self.index.close()
        del self.kv
        self._map.close()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    n = Node(tiny_model, tmp_path_factory.mktemp("kv-integrity"))
    try:
        yield n
    finally:
        n.close()


def answer(proc) -> list[int]:  # noqa: ANN001
    r = complete(proc, BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_prefix_hit_on_changed_blocks_recomputes_them(node: Node) -> None:
    a = node.engine("a", 0)
    node.command(a, "promote", "promoted")
    first = answer(a)
    pool = Pool(node)
    try:
        sealed = pool.digested()
        assert len(sealed) >= 3  # the prompt's full blocks, digested when sealed
        pool.scribble(sealed)
    finally:
        pool.close()
    assert answer(a) == first  # the changed blocks were recomputed, not reused
    hb = node.heartbeat(a, lambda m: m["kv_corrupt_blocks"] >= 1)
    assert hb["kv_checked_blocks"] >= hb["kv_corrupt_blocks"]
    assert "changed since they were sealed" in a.log_path.read_text()
    assert answer(a) == first  # and the recomputed blocks are hit again, whole
    assert node.heartbeat(a)["kv_corrupt_blocks"] == hb["kv_corrupt_blocks"]


def test_blocks_changed_under_a_dead_writer_are_not_adopted(node: Node) -> None:
    a = node.engines[-1]
    first = answer(a)
    kill(a)
    pool = Pool(node)
    try:
        sealed = pool.digested()
        pool.scribble(sealed)
    finally:
        pool.close()
    b = node.engine("b", 1)
    assert node.command(b, "promote", "adopted")["adopted_blocks"] >= len(sealed)  # adopted; checked when reused
    assert answer(b) == first
    assert node.heartbeat(b, lambda m: m["kv_corrupt_blocks"] >= 1)["kv_corrupt_blocks"] >= 1
    assert "changed since they were sealed" in b.log_path.read_text()


def test_a_digest_changes_with_any_element_and_with_nothing_else() -> None:
    layers = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]
    w = _weights(layers[0][:, 0].numel(), torch.device("cpu"))
    blocks = torch.tensor([1, 2, 5])
    before = block_digests(layers, blocks, w)
    assert torch.equal(before, block_digests(layers, blocks, w)) and bool((before != 0).all())
    layers[2].view(torch.int32)[1, 5, 3, 1, 7] ^= 1  # one bit of one value of block 5
    after = block_digests(layers, blocks, w)
    assert torch.equal(after[:2], before[:2]) and after[2] != before[2]
    half = [x.to(torch.bfloat16) for x in layers]
    assert block_digests(half, blocks, w).dtype == torch.int64


def test_the_bench_times_a_digest_call(capsys) -> None:
    from harness.bench.kv_digest import main
    assert main(["--blocks", "3", "--repeat", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["blocks"] == 3 and res["block_bytes"] == 4 * 2 * 16 * 2 * 16 * 4 and res["us_per_block"] > 0
