"""`understudy bench serve` for real: the CLI against a real `understudy serve` (tiny model, CPU),
the offline mode, and the ways a request fails (nothing listening, a cut stream, a 500)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest

from wire.loopback import free_port
from harness.bench.serve.metrics import HIT, QUERIED, parse_counters, prefix_delta
from harness.bench.serve.workloads import WORKLOADS, Lengths, Workload, make_requests
from harness import ROOT
from harness.node import running

CONFIG = """
runtime_dir: {rt}
device: cpu
model: {{path: {model}}}
engines: {{count: 1, heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
router: {{port: 0}}
admin: {{port: 0}}
"""


def bench(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "supervisor", "bench", "serve", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def sup(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("bench-serve")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model), notify=False) as h:
        yield h


def test_sweep_through_the_router_with_the_static_decode_beside_it(sup, tmp_path):
    out = tmp_path / "out"
    rc, stdout, stderr = bench("-c", str(sup.config), "--num-requests", "8", "--concurrency", "1,4",
                               "--input-len", "16", "--output-len", "8", "--out", str(out))
    assert rc == 0, stderr
    assert "point 2/2: concurrency 4" in stderr  # progress on stderr, the table on stdout
    assert "out tok/s" in stdout and "ratio" in stdout and "*: the max of fewer than 100 values" in stdout
    r = json.loads((out / "bench-serve.json").read_text())
    assert r["url"] == sup.router_url and r["max_model_len"] == 128 and r["total_errors"] == 0
    assert [p["concurrency"] for p in r["points"]] == [1, 4]
    for p in r["points"]:
        print(json.dumps(p))  # shown when an assertion fails
        assert (p["requests"], p["ok"], p["errors"]) == (8, 8, 0)
        assert p["output_tokens"] == 8 * 8 and p["output_tokens_from"] == "usage"
        assert p["prompt_tokens"] == 8 * 16
        assert p["output_tok_s"] > 0 and p["req_s"] > 0 and 0 < p["client_cpu"] < 2
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["max"] and p["ttft_ms"]["count"] == 8
        assert p["ttft_ms"]["p99"] is None  # (8 values: no p99, their max is shown, marked *)
        itl = p["itl_ms"]  # (a loaded machine may deliver a whole answer in one read: every gap 0, counted)
        assert itl["count"] == p["content_chunks"] - 8 and 0 <= p["itl_same_read"] <= itl["count"]
        assert (itl["max"] > 0) == (p["itl_same_read"] < itl["count"]), (itl, p["itl_same_read"])
        assert p["static_batch"] == p["concurrency"] and p["static_tok_s"] > 0
        assert p["ratio_to_static"] == pytest.approx(p["output_tok_s"] / p["static_tok_s"], rel=1e-2)
        pc = p["prefix_cache"]  # "n/a" until the engine exports the counters; never invented
        assert pc == "n/a" or 0 <= pc["hit_tokens"] <= pc["queried_tokens"]
    st = r["static"]
    assert set(st["tokens_per_s"]) == {"1", "4"} and st["device"] == "cpu"
    assert "--max-model-len" in st["command"] and st["command"][st["command"].index("--max-model-len") + 1] == "128"
    assert (out / "bench-serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_prefix_prompts_carry_the_prefix_over_two_client_processes(sup):
    rc, stdout, stderr = bench("-c", str(sup.config), "--workload", "shared-prefix", "--prefix-len", "64",
                               "--input-len", "8", "--output-len", "4", "--num-requests", "7", "--concurrency", "3",
                               "--client-procs", "2", "--no-static", "--json")
    assert rc == 0, stderr
    (p,) = json.loads(stdout)["points"]
    assert p["requests"] == p["ok"] == 7 and p["prompt_tokens"] == 7 * (64 + 8) and p["output_tokens"] == 7 * 4
    assert p["ttft_ms"]["count"] == 7 and p["duration_s"] > 0


def test_a_workload_that_does_not_fit_max_model_len_is_refused_before_sending(sup):
    rc, _, stderr = bench("-c", str(sup.config), "--input-len", "100:120", "--output-len", "16", "--no-static")
    assert rc == 2
    assert "120 + output up to 16 = 136 tokens exceeds max_model_len 128" in stderr


def test_offline_nano_runs_every_request_at_once_with_its_own_length(tiny_model, tmp_path):
    rc, stdout, stderr = bench("--workload", "nano", "--offline", str(tiny_model), "--num-requests", "6",
                               "--input-len", "8:24", "--output-len", "4:12", "--device", "cpu", "--json")
    assert rc == 0, stderr
    r = json.loads(stdout)
    (p,) = r["points"]
    w = Workload("nano", Lengths(8, 24), Lengths(4, 12))
    want = [s.max_tokens for s in make_requests(w, 6, 512, 0 + 7919)]
    assert len(set(want)) > 1  # the lengths do differ per request
    assert r["mode"] == "offline" and p["concurrency"] == 6 and p["ok"] == 6 and p["errors"] == 0
    assert p["output_tokens"] == sum(want) and p["output_tok_s"] > 0 and p["ttft_ms"]["p50"] > 0


def test_nothing_listening_counts_every_request_as_an_error(tmp_path):
    rc, stdout, stderr = bench("--url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--vocab", "100",
                               "--max-model-len", "64", "--num-requests", "3", "--concurrency", "2",
                               "--input-len", "4", "--output-len", "2", "--warmup", "0", "--out", str(tmp_path))
    assert rc == 1, stderr
    (p,) = json.loads((tmp_path / "bench-serve.json").read_text())["points"]
    assert (p["requests"], p["ok"], p["errors"]) == (3, 0, 3) and p["output_tok_s"] == 0
    assert "ConnectError" in p["error_samples"][0] and "error at 2: ConnectError" in stdout
    assert p["ttft_ms"] is None


class FakeServer:
    """A raw HTTP/1.1 peer on 127.0.0.1 answering every request the same way, then closing; the
    first ``unanswered`` connections it closes unanswered once their request is read. ``paths``:
    each request's path, in order."""

    def __init__(self, reply: bytes, unanswered: int = 0) -> None:
        self.reply, self.unanswered = reply, unanswered
        self.paths: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                lengths = [ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")]
                length = int(lengths[0]) if lengths else 0  # GET /v1/models and /metrics have no body
                while len(body) < length:
                    body += conn.recv(65536)
                self.paths.append(head.split(b" ", 2)[1])
                if len(self.paths) > self.unanswered:
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.parametrize("reply, expect", [
    # a stream that stops after one token: no [DONE], the connection closes
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
     + _chunk(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'), "stream cut"),
    # a complete stream carrying an error event
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
     + _chunk(b'data: {"error": {"message": "engine died"}}\n\n') + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n",
     "engine died"),
    (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 13\r\n\r\n"
     b'{"error": {}}', "HTTP 500"),
])
def test_cut_streams_and_error_answers_count_as_errors(reply, expect, tmp_path):
    srv = FakeServer(reply)
    try:
        rc, stdout, stderr = bench("--url", srv.url, "--model", "m", "--vocab", "100", "--max-model-len", "64",
                                   "--num-requests", "2", "--concurrency", "1", "--input-len", "4",
                                   "--output-len", "2", "--warmup", "0", "--json", timeout=120)
    finally:
        srv.close()
    assert rc == 1, stderr
    (p,) = json.loads(stdout)["points"]
    assert (p["ok"], p["errors"]) == (0, 2) and expect in p["error_samples"][0]


def test_prefix_hit_rate_comes_from_counter_deltas_or_is_na():
    page = (f"# TYPE {QUERIED} counter\n{QUERIED}{{engine=\"a\"}} 100.0\n{QUERIED}{{engine=\"b\"}} 50\n"
            f"{HIT}{{engine=\"a\"}} 40\n{HIT}_created 1.7e9\n")
    before = ("u", parse_counters(page))
    assert before[1] == {QUERIED: 150.0, HIT: 40.0}
    after = ("u", {QUERIED: 1150.0, HIT: 940.0})
    d = prefix_delta(before, after)
    assert (d.queried_tokens, d.hit_tokens, d.hit_rate) == (1000.0, 900.0, 0.9)
    assert prefix_delta(None, after) == "n/a" and prefix_delta(before, ("other", after[1])) == "n/a"
    assert parse_counters("understudy_router_requests_total 3\n") == {}


def test_workloads_have_the_sizes_of_the_spec():
    assert WORKLOADS["nano"].default_requests == 256 and WORKLOADS["nano"].all_at_once
    reqs = make_requests(WORKLOADS["shared-prefix"], 3, 1000, seed=1)
    assert all(len(r.prompt) == 1532 and r.max_tokens == 128 for r in reqs)
    assert reqs[0].prompt[:1500] == reqs[2].prompt[:1500] != reqs[0].prompt[1500:]
    assert all(64 <= len(r.prompt) <= 512 for r in make_requests(WORKLOADS["chat"], 50, 1000, seed=2))
    with pytest.raises(ValueError, match="--input-len: expected N or LO:HI"):
        Lengths.parse("x", "--input-len")
