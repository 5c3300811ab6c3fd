"""Issue 52 (C): what a local client that holds the node secret does to other clients by sending
4096-member `POST /v1/continuations` batches straight to the primary's port. One real node (the
embedded default: tiny preset, CPU); `clients` closed-loop clients send short completions through
the router for `phase` seconds with no attack, then for `phase` seconds while one attacker sends a
4096-member batch to the primary (the next as soon as one is answered or refused), once per
`--members` kind: `plain` (streamed completions with no ids, as a failover re-sends a request
before its first token) and `continued` (each member a continuation: prompt and output ids framed,
as a failover's); `outsider` sends the continued batch without the secret, as a local user who is not
the node's would (every one refused 401 on its head). Other clients' latency (request sent -> answer whole) is reported for each phase
(p99 over n >= 100, else the max of n); requests still unanswered when a phase ends are waited for
(up to `--drain`) and counted with their latency. Also checks that a request without the secret is
refused 401 on every engine.

    python bench/probes/batch_flood.py [--phase 40] [--clients 4] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import httpx

from harness.load import Load
from harness.node import Harness, running
from harness.stats import nearest_rank
from wire import node_secret
from wire.batch_wire import MAX_MEMBERS, encode_member



def node_config(workdir: Path, device: str = "cpu", model: str | None = None) -> str:
    """The embedded default with a private runtime dir and free ports, on `device` (with `model`: that
    checkpoint instead of the embedded one): nothing else changed."""
    import yaml
    from supervisor.config_load import load_config
    cfg = load_config(None).model_dump()
    cfg["runtime_dir"] = str(workdir / "rt")
    cfg["router"]["port"] = cfg["admin"]["port"] = 0
    cfg["admin"]["token_file"] = None
    cfg["device"] = device
    if model:
        cfg["model"]["path"] = model
    return yaml.safe_dump(cfg)


def batch_body(model: str, kind: str, members: int, max_tokens: int) -> bytes:
    """A batch of `members` streamed completions of `max_tokens` (continued ones: 8 prompt ids and
    4 output ids each, so `max_tokens - 4` left to make)."""
    parts = []
    for i in range(members):
        if kind == "plain":
            body = {"model": model, "prompt": f"Attack {i}", "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.0}
            parts.append(encode_member(b"/v1/completions", json.dumps(body).encode()))
        else:
            body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0}
            prompt = array("q", [(i * 7 + k) % 200 + 10 for k in range(8)])
            parts.append(encode_member(b"/v1/completions", json.dumps(body).encode(), prompt, array("q", [11, 12, 13, 14])))
    return b"".join(parts)


class Attacker:
    """One client sending `body` to `url` again and again until stopped; keeps each answer's status,
    time to its head and to its end, and the members' frame statuses it saw."""

    def __init__(self, url: str, headers: dict[str, str], body: bytes) -> None:
        self.url, self.headers, self.body = url, headers, body
        self.batches: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Attacker":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                rec: dict[str, Any] = {"sent": t0}
                try:
                    with c.stream("POST", self.url, content=self.body, headers=self.headers) as r:
                        rec.update(status=r.status_code, head_s=time.monotonic() - t0)
                        size, first = 0, b""
                        for chunk in r.iter_bytes():
                            size, first = size + len(chunk), first or chunk
                            if self._stop.is_set():
                                break  # (closing the connection stops every member)
                        rec.update(bytes=size, end_s=time.monotonic() - t0, whole=not self._stop.is_set())
                        if r.status_code != 200:
                            rec["error"] = first.decode(errors="replace")[:300]
                except httpx.HTTPError as e:
                    rec.update(error=repr(e)[:300], end_s=time.monotonic() - t0)
                self.batches.append(rec)


class HealthPoller:
    """The primary's /health every `every` s (with the secret): (t, running, waiting) rows."""

    def __init__(self, url: str, headers: dict[str, str], every: float = 0.5) -> None:
        self.url, self.headers, self.every = url, headers, every
        self.rows: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                h = httpx.get(self.url, headers=self.headers, timeout=5).json()
                self.rows.append((time.monotonic(), int(h.get("running", -1)), int(h.get("waiting", -1))))
            except (httpx.HTTPError, ValueError):
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def during(self, t0: float, t1: float) -> dict[str, Any]:
        rows = [r for r in self.rows if t0 <= r[0] < t1]
        if not rows:
            return {}
        waiting = sorted(r[2] for r in rows)
        return {"health_samples": len(rows), "waiting_max": waiting[-1], "waiting_median": waiting[len(waiting) // 2],
                "running_max": max(r[1] for r in rows)}


def latencies(load: Load, t0: float, t1: float) -> dict[str, Any]:
    """Other clients' requests sent in [t0, t1): n, failed, unfinished (still in flight now), median,
    p99 (or max of n) of those answered."""
    rows = [r for r in load._client.results if t0 <= r.sent < t1]
    ok = [r.latency for r in rows if r.ok]
    unfinished = [time.monotonic() - r.sent for r in rows if r.end is None]
    out: dict[str, Any] = {"n": len(rows), "failed": sum(1 for r in rows if r.end is not None and not r.ok),
                           "unfinished": len(unfinished)}
    if unfinished:
        out["unfinished_waited_s_max"] = round(max(unfinished), 1)
    if ok:
        out["median_ms"] = round(nearest_rank(ok, 50) * 1e3, 1)
        key = "p99_ms" if len(ok) >= 100 else f"max_of_{len(ok)}_ms"
        out[key] = round((nearest_rank(ok, 99) if len(ok) >= 100 else max(ok)) * 1e3, 1)
        out["max_ms"] = round(max(ok) * 1e3, 1)
    return out


def unauthenticated(h: Harness, model: str) -> dict[str, Any]:
    """Status codes an engine gives requests without the secret (and with a wrong one)."""
    out = {}
    for e in h.engines().values():
        body = batch_body(model, "plain", 1, 4)
        out[e["name"]] = {
            "completions_no_secret": httpx.post(e["url"] + "/v1/completions", json={"model": model, "prompt": "x",
                                                                                    "max_tokens": 2}, timeout=30).status_code,
            "continuations_no_secret": httpx.post(e["url"] + "/v1/continuations", content=body, timeout=30).status_code,
            "continuations_wrong_secret": httpx.post(e["url"] + "/v1/continuations", content=body, timeout=30,
                                                     headers={node_secret.HEADER.decode(): "0" * 64}).status_code,
            "health_with_secret": httpx.get(e["url"] + "/health", headers=node_secret.headers(h.rd), timeout=30).status_code,
        }
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"members": MAX_MEMBERS, "phase_s": args.phase, "clients": args.clients}
    with running(work, node_config(work, args.device, args.model), ready_timeout_s=300) as h:
        model = httpx.get(h.router_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        out["no_secret"] = unauthenticated(h, model)
        prim = h.primary()
        url, secret = prim["url"] + "/v1/continuations", node_secret.headers(h.rd)
        phases: list[tuple[str, float, float, Attacker | None]] = []
        poller = HealthPoller(prim["url"] + "/health", secret)
        with Load(h.router_url, model, threads=args.clients, max_tokens=args.max_tokens) as load:
            time.sleep(3)  # warm
            t = time.monotonic()
            time.sleep(args.phase)
            phases.append(("no attack", t, time.monotonic(), None))
            for kind in args.kinds.split(","):
                body = batch_body(model, "continued" if kind == "outsider" else kind, MAX_MEMBERS, args.attack_tokens)
                t = time.monotonic()
                with Attacker(url, {} if kind == "outsider" else secret, body) as att:
                    time.sleep(args.phase)
                    t_end = time.monotonic()
                phases.append((f"attack: {kind} members ({len(body)} bytes a batch)", t, t_end, att))
                deadline = time.monotonic() + args.drain  # the requests sent in the phase finish (or not)
                while time.monotonic() < deadline and any(r.sent < t_end and r.end is None for r in load._client.results):
                    time.sleep(0.5)
                time.sleep(2)
                t = time.monotonic()  # a quiet phase again after each attack
                time.sleep(args.phase / 2)
                phases.append(("no attack, after", t, time.monotonic(), None))
        poller.stop()
        out["phases"] = []
        for name, t0, t1, att in phases:
            row: dict[str, Any] = {"phase": name, "seconds": round(t1 - t0, 1), **latencies(load, t0, t1),
                                   **poller.during(t0, t1)}
            if att is not None:
                statuses = [b.get("status", "error") for b in att.batches]
                row["batch_statuses"] = {str(x): statuses.count(x) for x in set(statuses)}
                if len(att.batches) <= 200:  # (an outsider's thousands of 401s: counted only)
                    row["batches"] = [{k: (round(v - t0, 2) if k == "sent" else round(v, 3) if isinstance(v, float)
                                       else v) for k, v in b.items()} for b in att.batches]
            out["phases"].append(row)
            print(json.dumps(row), flush=True)
        base = next(p for p in out["phases"] if p["phase"] == "no attack")
        for p in out["phases"]:
            if p["phase"].startswith("attack") and "p99_ms" in p and "p99_ms" in base:
                p["p99_ratio_to_no_attack"] = round(p["p99_ms"] / base["p99_ms"], 2)
        st = h.status()
        out["epoch"], out["failovers"] = st["epoch"], len([e for e in h.events if e.get("type") == "failover"])
        out["primary_batch_lines"] = [ln for f in sorted((h.rd / "logs").glob(f"{prim['name']}-*.log"))
                                      for ln in f.read_text(errors="replace").splitlines() if " members answered" in ln]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", type=float, default=40.0, help="seconds per phase (%(default)s)")
    p.add_argument("--clients", type=int, default=4, help="other clients, closed loop through the router (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per other client's request (%(default)s)")
    p.add_argument("--attack-tokens", type=int, default=20, help="max_tokens of each attacking member (%(default)s)")
    p.add_argument("--kinds", default="plain,continued", help="attack member kinds, in turn: plain, continued, outsider (%(default)s)")
    p.add_argument("--drain", type=float, default=120.0, help="seconds to wait for a phase's requests (%(default)s)")
    p.add_argument("--device", default="cpu", help="the node's device (%(default)s)")
    p.add_argument("--model", help="a checkpoint folder (default: the embedded default's model)")
    p.add_argument("--out", help="folder for summary.json and supervisor.log")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-flood-") as tmp:
        try:
            out = run(args, Path(tmp))
        finally:
            if args.out:
                import shutil
                Path(args.out).mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / "supervisor.log", Path(args.out) / "supervisor.log")
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.out:
        (Path(args.out) / "summary.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
