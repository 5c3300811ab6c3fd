"""Client load through the router, from threads: ``Load`` sends completions back to back (closed loop,
kept-alive connections; it can tell when an engine first serves after a moment), ``OpenLoad`` one
every 1/rate s whatever the answers, each on a fresh connection (so refused connections are seen)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Load:
    """Steady load: ``threads`` clients sending completions back to back through the router.
    With ``bodies``, client i sends bodies i, i + threads, ... in turn (each with ``stream`` and
    the model set) and every 200's text lands in ``replies`` as (body index, text)."""

    url: str
    model: str
    threads: int = 2
    max_tokens: int = 4
    stream: bool = False
    results: list[tuple[float, float, int | str, str | None]] = field(default_factory=list)
    bodies: list[dict] | None = None
    replies: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._watch: tuple[str, float, threading.Event, list[float]] | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self, client: int = 0) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0.0, "stream": self.stream}
        turn = client
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                if self.bodies:
                    index = turn % len(self.bodies)
                    body = {**self.bodies[index], "model": self.model, "stream": self.stream}
                    turn += self.threads
                t0 = time.monotonic()
                try:
                    ok, engine, text = self.send(c, body)
                    if self.bodies and ok == 200:
                        self.replies.append((index, text))
                    end = time.monotonic()
                    self.results.append((t0, end, ok, engine))
                    w = self._watch
                    if w is not None and ok == 200 and engine == w[0] and end >= w[1] and not w[2].is_set():
                        w[3].append(end)
                        w[2].set()
                except httpx.HTTPError as e:
                    self.results.append((t0, time.monotonic(), f"{type(e).__name__}: {e}", None))

    def send(self, c: httpx.Client, body: dict) -> tuple[int | str, str | None, str]:
        """One completion: (status, or "stream cut" for a stream without [DONE]; the engine that
        answered; the generated text, "" unless 200)."""
        r = c.post(self.url + "/v1/completions", json=body)
        ok: int | str = r.status_code
        if self.stream and r.status_code == 200 and "[DONE]" not in r.text:
            ok = "stream cut"
        return ok, r.headers.get("x-understudy-engine"), reply_text(r.text, self.stream) if ok == 200 else ""

    def one(self, body: dict) -> str:
        """The text of one completion of `body` (model and stream set), sent alone; raises unless 200."""
        with httpx.Client(timeout=60) as c:
            ok, _, text = self.send(c, {**body, "model": self.model, "stream": self.stream})
            if ok != 200:
                raise RuntimeError(f"a completion failed: {ok}")
        return text

    @property
    def failures(self) -> list:
        return [r for r in self.results if r[2] != 200]

    def watch(self, engine: str, after: float) -> tuple[threading.Event, list[float]]:
        """An event set (with its completion time) by the first success from ``engine`` after ``after``."""
        ev, out = threading.Event(), []
        self._watch = (engine, after, ev, out)
        return ev, out

    def first_success_from(self, engine: str, after: float) -> float | None:
        """Completion time of the first success served by ``engine`` that started after ``after``."""
        times = [end for start, end, code, eng in self.results if code == 200 and eng == engine and end >= after]
        return min(times) if times else None


def reply_text(body: str, stream: bool) -> str:
    """The generated text of a completion's reply (its SSE chunks joined when streamed)."""
    if not stream:
        return json.loads(body)["choices"][0]["text"]
    text = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            text += [c.get("text") or "" for c in chunk.get("choices") or []]
    return "".join(text)


class OpenLoad:
    """Open-loop load: a completion every 1/rate s whatever the answers, each on a fresh connection
    (so refused connections are seen), with http.client (light on CPU). ``results``: (start, end,
    outcome) with outcome "ok", "refused", "HTTP <code>" or the error."""

    def __init__(self, url: str, model: str, rate: float = 20.0, max_tokens: int = 4) -> None:
        self.url, self.model, self.rate, self.max_tokens = url, model, rate, max_tokens
        self.results: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def start(self) -> "OpenLoad":
        self._ticker.start()
        return self

    def _tick(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self.one, daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            nxt += 1 / self.rate
            time.sleep(max(0.0, nxt - time.monotonic()))

    def one(self, max_tokens: int | None = None) -> None:
        """One request (``max_tokens`` generated, EOS ignored); its outcome is appended to results."""
        import http.client
        t0 = time.monotonic()
        body = json.dumps({"model": self.model, "prompt": "Once upon a time", "temperature": 0.0,
                           "max_tokens": max_tokens or self.max_tokens, "ignore_eos": True})
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            outcome = "ok" if r.status == 200 else f"HTTP {r.status}"
        except ConnectionRefusedError:
            outcome = "refused"
        except (OSError, http.client.HTTPException) as e:
            outcome = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        self.results.append((t0, time.monotonic(), outcome))

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(5)
        for t in list(self._threads):
            t.join(90)
