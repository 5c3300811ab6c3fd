"""The weight cache daemon with real processes: serve, attach, share, survive, refuse, recover."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from daemon.client import CacheMiss, WeightCacheError, attach, attach_or_load, load_from_disk
from daemon.fingerprint import make_cache_config
from daemon.framing import FrameError, recv_frame, send_frame
from daemon.runtime_dir import daemon_socket_path
from models import CheckpointError, build_model, read_model_args

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

CLIENT = r"""
import hashlib, json, sys, torch
from daemon.client import attach_or_load
from daemon.fingerprint import make_cache_config
from models import CheckpointError, build_model, read_model_args
model_dir, runtime_dir = sys.argv[1], sys.argv[2]
model = build_model(read_model_args(model_dir), device="meta")
res = attach_or_load(model, make_cache_config(model_dir), "client", runtime_dir, 0, "cpu")
def digest():
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
print(json.dumps({"source": res.source, "digest": digest()}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "read":
        print(json.dumps({"digest": digest()}), flush=True)
    elif cmd == "write":
        model.lm_head.weight.add_(1.0)   # through the PROT_READ mapping: must fault
        print(json.dumps({"wrote": True}), flush=True)
    else:
        break
"""


def model_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def meta_model(model_dir: Path, **kw) -> torch.nn.Module:
    return build_model(read_model_args(model_dir), device="meta", **kw)


def disk_digest(model_dir: Path) -> str:
    model = meta_model(model_dir)
    load_from_disk(model, model_dir, torch.device("cpu"))
    return model_digest(model)


# Runs the daemon as another uid: the interpreter lives under a 0700 home, so it starts as root,
# imports everything it will need, then drops to the uid before serving.
AS_UID = r"""
import os, sys
import daemon.cli, daemon.server, daemon.loader, daemon.transport_cpu, models
uid = int(sys.argv[1]); os.setgroups([]); os.setgid(uid); os.setuid(uid)
daemon.cli.main(sys.argv[2:])
"""


class Daemon:
    """A real `python -m daemon` process with its stderr in a file."""

    def __init__(self, model_dir: Path, runtime_dir: Path, *extra: str, drop_to_uid: int | None = None,
                 env: dict | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.log = Path(tempfile.mkstemp(prefix="daemon-", suffix=".log", dir=runtime_dir.parent)[1])
        argv = ["--model", str(model_dir), "--runtime-dir", str(runtime_dir), *extra]
        cmd = [PY, "-m", "daemon", *argv] if drop_to_uid is None else [PY, "-c", AS_UID, str(drop_to_uid), *argv]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)

    def request(self, obj: dict) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(daemon_socket_path(self.runtime_dir, 0)))
            send_frame(s, obj)
            reply, fds = recv_frame(s)
            assert not fds
            return reply

    def wait_state(self, state: str = "ready", timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"daemon exited {self.proc.returncode}: {self.output()}"
            try:
                reply = self.request({"op": "status"})
                if reply["daemon"]["state"] == state:
                    return reply
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not {state} after {timeout} s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    return tmp_path / "rt"


@pytest.fixture(scope="module")
def shared_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One daemon for the tests that leave it alive and serving (they check that it is)."""
    d = Daemon(tiny_model, tmp_path_factory.mktemp("shared") / "rt")
    d.wait_state("ready")
    yield d
    d.proc.kill()
    d.proc.wait()


@pytest.fixture
def own_daemon(tiny_model: Path, runtime_dir: Path):
    """A daemon this test may kill."""
    d = Daemon(tiny_model, runtime_dir)
    d.wait_state("ready")
    yield d
    d.proc.kill()
    d.proc.wait()


def start_client(model_dir: Path, runtime_dir: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([PY, "-c", CLIENT, str(model_dir), str(runtime_dir)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"client died: {proc.stderr.read()}"
    return proc, json.loads(line)


def ask(proc: subprocess.Popen, cmd: str) -> dict:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_two_clients_share_weights_and_outlive_a_killed_daemon(tiny_model, own_daemon, runtime_dir):
    daemon = own_daemon
    sock = daemon_socket_path(runtime_dir, 0)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    expected = disk_digest(tiny_model)
    a, first_a = start_client(tiny_model, runtime_dir)
    b, first_b = start_client(tiny_model, runtime_dir)
    try:
        assert first_a == first_b == {"source": "cache_hit", "digest": expected}
        assert daemon.request({"op": "status"})["daemon"]["attaches"] == 2
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert ask(a, "read") == ask(b, "read") == {"digest": expected}
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    assert sock.exists(), "a SIGKILLed daemon leaves its socket behind"
    with pytest.raises(CacheMiss) as miss:  # the stale socket is a miss, not a hang
        attach(meta_model(tiny_model), make_cache_config(tiny_model), runtime_dir, 0, torch.device("cpu"))
    assert miss.value.reason == "no_daemon"
    again = Daemon(tiny_model, runtime_dir)  # replaces the stale socket
    try:
        again.wait_state("ready")
        assert "replacing stale socket" in again.output()
    finally:
        assert again.stop() == 0
    assert not sock.exists()


def test_a_client_cannot_write_the_shared_weights(tiny_model, shared_daemon):
    daemon, runtime_dir = shared_daemon, shared_daemon.runtime_dir
    writer, first = start_client(tiny_model, runtime_dir)
    assert first["source"] == "cache_hit"
    writer.stdin.write("write\n")
    writer.stdin.flush()
    assert writer.wait(timeout=30) == -signal.SIGSEGV, writer.stderr.read()
    reader, seen = start_client(tiny_model, runtime_dir)
    reader.kill()
    reader.wait()
    assert seen["digest"] == first["digest"] == disk_digest(tiny_model)
    # the fd itself is sealed: no write() and no writable mapping, even for a client that tries
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon_socket_path(runtime_dir, 0)))
        send_frame(s, {"op": "attach", "fingerprint": make_cache_config(tiny_model).model_dump()})
        reply, fds = recv_frame(s)
    try:
        assert reply["type"] == "ok" and len(fds) == 2
        with pytest.raises(PermissionError):
            os.pwrite(fds[0], b"x", 0)
        import mmap
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], reply["arena"]["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    finally:
        for fd in fds:
            os.close(fd)


FLIPS = {"model_path": "/elsewhere", "arch": "OtherForCausalLM", "content_digest": "0" * 64, "tp_size": 2,
         "tp_rank": 1, "pp_size": 2, "pp_rank": 1, "dp_size": 2, "ep_size": 2, "quant_method": "fp8",
         "quant_config_hash": "abc", "quant_processing": "fp8-rows-v0", "dtype": "bfloat16", "device_capability": "sm_90",
         "device_uuid": "GPU-other", "torch_version": "0.0", "layout_version": 99}


def test_each_fingerprint_field_flipped_is_a_miss_naming_it(tiny_model, shared_daemon):
    daemon, runtime_dir = shared_daemon, shared_daemon.runtime_dir
    config = make_cache_config(tiny_model)
    assert set(FLIPS) == set(config.model_dump()), "every CacheConfig field must be flipped here"
    hit = attach(meta_model(tiny_model), config, runtime_dir, 0, torch.device("cpu"))
    assert hit.source == "cache_hit"
    for name, value in FLIPS.items():
        with pytest.raises(CacheMiss) as miss:
            attach(meta_model(tiny_model), config.model_copy(update={name: value}), runtime_dir, 0,
                   torch.device("cpu"))
        assert miss.value.reason == "mismatch", name
        assert f"{name} (ours" in str(miss.value) and str(miss.value).count("(ours") == 1, str(miss.value)


def test_weights_replaced_at_the_same_path_are_a_miss(make_tiny, tmp_path):
    model_dir = make_tiny(seed=11)
    other = make_tiny(seed=12)
    rt = tmp_path / "rt"
    d = Daemon(model_dir, rt)
    try:
        d.wait_state("ready")
        before = make_cache_config(model_dir)
        assert attach(meta_model(model_dir), before, rt, 0, torch.device("cpu")).source == "cache_hit"
        target = model_dir / "model.safetensors"
        with open(target, "r+b") as f:  # same path, same inode, same size: new bytes
            f.write((other / "model.safetensors").read_bytes())
        after = make_cache_config(model_dir)
        assert after.content_digest != before.content_digest
        with pytest.raises(CacheMiss) as miss:
            attach(meta_model(model_dir), after, rt, 0, torch.device("cpu"))
        assert miss.value.reason == "mismatch" and "content_digest" in str(miss.value)
        res = attach_or_load(meta_model(model_dir), after, "client", rt, 0, "cpu")
        assert res.source == "disk:mismatch"
    finally:
        d.stop()


def test_client_mode_falls_back_to_disk_on_every_miss(make_tiny, tiny_model, tmp_path):
    expected = disk_digest(tiny_model)

    def load(model_dir: Path, rt: Path, **kw) -> tuple[str, str]:
        model = meta_model(model_dir)
        res = attach_or_load(model, make_cache_config(model_dir), "client", rt, 0, "cpu", **kw)
        return res.source, model_digest(model)

    assert load(tiny_model, tmp_path / "nothing-here") == ("disk:no_daemon", expected)

    quant = tmp_path / "gptq"  # never loaded as if unquantized, in any mode: config.json is refused
    shutil.copytree(tiny_model, quant)
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        load(quant, tmp_path / "nothing-here")

    rt = tmp_path / "slow"
    slow = Daemon(tiny_model, rt, "--max-load-mbps", "0.02")  # ~30 s to fill: still loading
    try:
        slow.wait_state("loading")
        with socket.socket(socket.AF_UNIX) as s:  # while filling: progress, and never an fd
            s.connect(str(daemon_socket_path(rt, 0)))
            deadline = time.monotonic() + 20
            while True:  # bytes_total is known once the model is laid out and the read starts
                send_frame(s, {"op": "attach", "fingerprint": make_cache_config(tiny_model).model_dump()})
                reply, fds = recv_frame(s)
                assert reply["type"] == "loading" and fds == [], reply
                if reply["progress"]["bytes_total"] or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        progress = reply["progress"]
        assert progress["bytes_total"] == (tiny_model / "model.safetensors").stat().st_size - _header_bytes(tiny_model)
        assert 0 <= progress["bytes_done"] < progress["bytes_total"]
        assert load(tiny_model, rt, wait_s=0.3) == ("disk:loading_timeout", expected)
        assert load(tiny_model, rt, wait_s=0.3)[0] == "disk:loading_timeout"
        other = make_tiny(seed=5)  # the daemon holds another checkpoint
        assert load(other, rt, wait_s=0.3)[0] == "disk:mismatch"
    finally:
        assert slow.stop() == 0


def _header_bytes(model_dir: Path) -> int:
    with open(model_dir / "model.safetensors", "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_concurrent_clients_all_attach(tiny_model, shared_daemon):
    from concurrent.futures import ThreadPoolExecutor

    config = make_cache_config(tiny_model)

    def one(_):
        model = meta_model(tiny_model)
        res = attach(model, config, shared_daemon.runtime_dir, 0, torch.device("cpu"))
        return res.source, model_digest(model)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert results == [("cache_hit", disk_digest(tiny_model))] * 16


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the daemon as another uid")
def test_client_of_another_uid_is_refused_and_falls_back(tiny_model):
    nobody = 65534
    base = Path(tempfile.mkdtemp(prefix="understudy-uid-"))
    try:
        os.chmod(base, 0o755)
        model = base / "model"
        shutil.copytree(tiny_model, model)
        for p in [model, *model.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        home = base / "home"
        home.mkdir()
        os.chown(home, nobody, nobody)
        env = {**os.environ, "HOME": str(home), "UNDERSTUDY_CACHE_DIR": str(home / "cache")}
        d = Daemon(model, home / "rt", drop_to_uid=nobody, env=env)
        try:
            deadline = time.monotonic() + 30
            while "ready:" not in d.output():  # status would be refused: watch the log instead
                assert d.proc.poll() is None and time.monotonic() < deadline, d.output()
                time.sleep(0.05)
            # we are root, so the 0700 dir does not stop us; the SO_PEERCRED check must
            reply = d.request({"op": "status"})
            assert reply["type"] == "error" and "uid 0 refused" in reply["message"]
            with pytest.raises(CacheMiss) as miss:
                attach(meta_model(model), make_cache_config(model), home / "rt", 0, torch.device("cpu"))
            assert miss.value.reason == "refused" and "uid 0" in str(miss.value)
            res = attach_or_load(meta_model(model), make_cache_config(model), "client", home / "rt", 0, "cpu")
            assert res.source == "disk:refused"
        finally:
            d.proc.kill()
            d.proc.wait()
    finally:
        shutil.rmtree(base)


def test_daemon_mode_starts_a_daemon_or_fails_clearly(make_tiny, tiny_model, tmp_path):
    rt = tmp_path / "rt"
    model = meta_model(tiny_model)
    res = attach_or_load(model, make_cache_config(tiny_model), "daemon", rt, 0, "cpu")
    assert res.source == "cache_hit"
    assert model_digest(model) == disk_digest(tiny_model)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon_socket_path(rt, 0)))
        send_frame(s, {"op": "status"})
        pid = recv_frame(s)[0]["daemon"]["pid"]
    try:
        other = make_tiny(seed=9)
        with pytest.raises(WeightCacheError, match="content_digest"):
            attach_or_load(meta_model(other), make_cache_config(other), "daemon", rt, 0, "cpu")
    finally:
        os.kill(pid, signal.SIGTERM)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(broken / "model.safetensors") - 1000)
    with pytest.raises(WeightCacheError, match=r"exited with code 1: .*truncated"):
        attach_or_load(meta_model(broken), make_cache_config(broken), "daemon", tmp_path / "rt2", 0, "cpu")


def test_a_second_daemon_for_a_live_rank_is_refused(tiny_model, shared_daemon):
    daemon, runtime_dir = shared_daemon, shared_daemon.runtime_dir
    second = Daemon(tiny_model, runtime_dir)
    assert second.proc.wait(timeout=30) == 2
    assert "already serves rank 0" in second.output()
    assert daemon.request({"op": "ping"})["type"] == "ok"


def test_sigterm_exits_zero_and_removes_the_socket(tiny_model, runtime_dir):
    d = Daemon(tiny_model, runtime_dir)
    d.wait_state("ready")
    assert d.stop() == 0
    assert not daemon_socket_path(runtime_dir, 0).exists()


def test_garbage_on_the_socket_leaves_the_daemon_serving(tiny_model, shared_daemon):
    daemon, runtime_dir = shared_daemon, shared_daemon.runtime_dir
    path = str(daemon_socket_path(runtime_dir, 0))
    rng = torch.Generator().manual_seed(0)
    bad_frames = [
        (0xFFFFFFFF).to_bytes(4, "big"),  # oversized
        (2 << 20).to_bytes(4, "big") + b"{}",  # over the cap
        (0).to_bytes(4, "big"),  # empty
        (5).to_bytes(4, "big") + b"\xff\xfe{}x",  # not UTF-8
        (4).to_bytes(4, "big") + b"[1] ",  # not an object
        (9).to_bytes(4, "big") + b"not json!",
        (10).to_bytes(4, "big") + b"{}",  # body shorter than announced, then close
        b"\x00\x00",  # header cut short
    ] + [bytes(torch.randint(0, 256, (int(n),), generator=rng).tolist())
         for n in torch.randint(1, 4096, (150,), generator=rng)]
    answers = {"error": 0, "closed": 0}
    for frame in bad_frames:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            try:
                reply, _ = recv_frame(s)
            except (FrameError, OSError):  # closed on us: allowed (a wrong reply is not)
                answers["closed"] += 1
                continue
            assert reply["type"] == "error" and reply["message"], reply
            answers["error"] += 1
    assert answers["error"] > 100, answers
    # well-formed frames with bad requests keep the connection open
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        for bad in ({"op": "bogus"}, {"op": "attach"}, {"op": "attach", "fingerprint": {"x": 1}}, {"nope": 1}):
            send_frame(s, bad)
            reply, _ = recv_frame(s)
            assert reply["type"] == "error" and "bad request" in reply["message"], reply
        r, w = os.pipe()
        send_frame(s, {"op": "ping"}, [r, w])  # fds a client should not send are closed, not kept
        assert recv_frame(s)[0]["type"] == "ok"
        os.close(r)
        os.close(w)
    # many bad connections at once, good clients served alongside
    socks = []
    for i in range(40):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b"\x00\x00\x10")  # half a header, then silence
        socks.append(s)
    try:
        hit = attach(meta_model(tiny_model), make_cache_config(tiny_model), runtime_dir, 0, torch.device("cpu"))
        assert hit.source == "cache_hit"
    finally:
        for s in socks:
            s.close()
    status = daemon.request({"op": "status"})["daemon"]
    assert status["state"] == "ready" and daemon.proc.poll() is None
