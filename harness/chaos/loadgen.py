"""Open-loop load at a fixed arrival rate through the data port; every request becomes a record."""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from .records import ENGINE_HEADER, EPOCH_HEADER, RETRIES_HEADER, RequestRecord

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _int_header(resp: httpx.Response, name: str) -> int | None:
    value = resp.headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class LoadGenerator:
    """Sends `rate` requests/s (at most `concurrency` in flight) until stopped or the deadline."""

    def __init__(
        self,
        data_url: str,
        model: str,
        *,
        rate: float,
        concurrency: int,
        mix: dict[str, float],
        stream_fraction: float,
        max_tokens: int,
        timeout_s: float,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.rate = rate
        self.concurrency = concurrency
        self.mix = mix
        self.stream_fraction = stream_fraction
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []
        self.not_sent = 0
        self._rng = random.Random(seed)
        self._inflight: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(
            base_url=data_url,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            trust_env=False,
        )

    async def run(self, stop: asyncio.Event, deadline: float) -> None:
        """Send until `stop` is set or time.time() passes `deadline`; then let in-flight finish."""
        gap = 1.0 / self.rate
        next_t = time.time()
        try:
            while not stop.is_set() and time.time() < deadline:
                delay = next_t - time.time()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                        break
                    except asyncio.TimeoutError:
                        pass
                elif delay < -1.0:
                    next_t = time.time()  # fell behind (e.g. a stalled loop): do not burst
                next_t += gap
                if len(self._inflight) >= self.concurrency:
                    self.not_sent += 1
                    continue
                task = asyncio.create_task(self._one(self._next_record()))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            if self._inflight:
                await asyncio.wait(set(self._inflight), timeout=self.timeout_s + 2.0)
        finally:
            for task in list(self._inflight):
                task.cancel()
            await self._http.aclose()

    def _next_record(self) -> RequestRecord:
        endpoints = list(self.mix)
        endpoint = self._rng.choices(endpoints, weights=[self.mix[e] for e in endpoints])[0]
        stream = self._rng.random() < self.stream_fraction
        rec = RequestRecord(id=len(self.records), endpoint=endpoint, stream=stream, t_start=time.time())
        self.records.append(rec)
        return rec

    def _payload(self, rec: RequestRecord) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": rec.stream,
        }
        if rec.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            body["prompt"] = PROMPT
        return body

    async def _one(self, rec: RequestRecord) -> None:
        try:
            async with self._http.stream("POST", PATHS[rec.endpoint], json=self._payload(rec)) as resp:
                rec.status = resp.status_code
                rec.engine = resp.headers.get(ENGINE_HEADER)
                rec.epoch = _int_header(resp, EPOCH_HEADER)
                rec.retries = _int_header(resp, RETRIES_HEADER)
                if resp.status_code != 200:
                    await resp.aread()
                    rec.error = f"http_{resp.status_code}"
                elif rec.stream:
                    await self._read_stream(rec, resp)
                else:
                    rec.t_first = time.time()
                    await self._read_body(rec, resp)
        except httpx.TimeoutException:
            rec.error = "timeout"
        except httpx.ConnectError:
            rec.error = "connect"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            rec.error = "stream_broken" if rec.status == 200 else "disconnected"
        except httpx.HTTPError as exc:
            rec.error = f"http_error:{type(exc).__name__}"
        except asyncio.CancelledError:
            rec.error = "cancelled_at_stop"
            raise
        finally:
            rec.t_end = time.time()
            rec.ok = rec.error is None

    async def _read_body(self, rec: RequestRecord, resp: httpx.Response) -> None:
        raw = await resp.aread()
        try:
            body = json.loads(raw)
        except ValueError:
            rec.error = "bad_body"
            return
        if not isinstance(body, dict) or not body.get("choices"):
            rec.error = "bad_body"
            return
        rec.response_id = body.get("id")
        choice = body["choices"][0]
        rec.text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")

    async def _read_stream(self, rec: RequestRecord, resp: httpx.Response) -> None:
        """Read a stream whole: its text, the longest wait between chunks, and whether it was cut (no
        finish_reason and [DONE], an error event, or a broken connection: then `cut` is set)."""
        done, chunks, finished, text = False, 0, False, []
        last, rec.max_gap_s = rec.t_start, 0.0
        rec.cut = True  # until the stream proves whole
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.time()
            rec.max_gap_s, last = max(rec.max_gap_s, now - last), now
            data = line[5:].strip()
            if len(rec.chunk_times) < 4096:
                rec.chunk_times.append(now)
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.error = "bad_chunk"
                return
            if isinstance(chunk, dict) and "error" in chunk:
                rec.error = "stream_error"
                return
            if rec.t_first is None:
                rec.t_first = now
                rec.response_id = chunk.get("id")
            for ch in chunk.get("choices") or ():
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                finished = finished or ch.get("finish_reason") is not None
            chunks += 1
        rec.text = "".join(text)
        if not done or chunks == 0 or not finished:
            rec.error = "stream_broken"
        else:
            rec.cut = False
