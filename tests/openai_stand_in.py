"""An OpenAI-compatible stand-in for a third-party engine (run as `python stand_in.py ...` by an external
engine's command), with a model whose text is known here: a token is a character (its id its code point),
and the next one a function of every id before it, so a replay by text is exact and each answer can be
computed in the test. Its command-line modes:

- ``ids``: takes prompts of token ids and returns ids (vLLM's ``return_token_ids``) and continues a final
  assistant message (``continue_final_message``); ``chat``: the latter only; ``text``: neither, refusing any
  field it does not know with 422, and prompts that are not text, as ``transformers serve`` does;
- ``/v1/models``: ``id:NAME`` lists NAME (the only model it answers for: 400 otherwise, as a pinned
  ``transformers serve`` does), ``file:PATH`` the id in PATH (read at start), ``garbage`` answers HTML,
  ``none`` has no such route (404), ``hang`` never answers.

Also the client side of the tests: a stream read chunk by chunk, its text and its error event if any."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from harness.node import Harness

STAND_IN = textwrap.dedent('''
    import json, sys, time, uuid, asyncio
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    port, name, mode, models, delay, log = sys.argv[1:7]
    port, delay = int(port), float(delay)
    model_id = open(models[5:]).read().strip() if models.startswith("file:") else models[3:]
    KNOWN = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options", "seed", "top_p"}
    if mode in ("ids", "chat"):
        KNOWN |= {"continue_final_message", "add_generation_prompt"}
    if mode == "ids":
        KNOWN |= {"return_token_ids"}
    app = FastAPI()

    def next_id(ids):
        return 97 + (sum(ids) * 7 + len(ids) * 13) % 26

    def note(**kw):
        with open(f"{log}-{name}", "a") as f:
            f.write(json.dumps(kw) + "\\n")

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def list_models():
        if models == "garbage":
            return PlainTextResponse("<html>it works</html>")
        if models == "none":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if models == "hang":
            await asyncio.sleep(3600)
        return {"object": "list", "data": [{"id": model_id, "object": "model"}]}

    def refuse(body):
        if set(body) - KNOWN:
            return JSONResponse({"detail": f"Unexpected fields in the request: {set(body) - KNOWN}"}, status_code=422)
        if models not in ("none",) and body.get("model") != model_id:
            return JSONResponse({"detail": f"Server is pinned to {model_id!r}; requested {body.get('model')!r}"},
                                status_code=400)
        return None

    def answer(body, ids, chat):
        rid, created, rti = "cmpl-" + uuid.uuid4().hex, int(time.time()), bool(body.get("return_token_ids"))
        n, out = int(body.get("max_tokens") or 16), []
        for _ in range(n):
            out.append(next_id(ids + out))
        obj = "chat.completion.chunk" if chat else "text_completion"
        def chunk(tok, first):
            ch = {"index": 0, "finish_reason": None}
            if chat:
                ch["delta"] = {"content": chr(tok)}
            else:
                ch["text"] = chr(tok)
            if rti:
                ch["token_ids"] = [tok]
                if first:
                    ch["prompt_token_ids"] = ids
            return {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [ch]}
        if not body.get("stream"):
            text = "".join(map(chr, out))
            ch = {"index": 0, "finish_reason": "length"}
            ch.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if rti:
                ch.update(token_ids=out, prompt_token_ids=ids)
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": model_id, "choices": [ch]}
        async def events():
            if chat:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_id,
                    "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}) + "\\n\\n"
            for i, tok in enumerate(out):
                await asyncio.sleep(delay)
                yield "data: " + json.dumps(chunk(tok, i == 0)) + "\\n\\n"
            end = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_id,
                                         "choices": [end]}) + "\\n\\n"
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if (bad := refuse(body)) is not None:
            return bad
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = [ord(c) for c in prompt]
        elif mode == "ids" and isinstance(prompt, list) and all(type(i) is int for i in prompt):
            ids = prompt
        else:
            return JSONResponse({"detail": "prompt must be a string."}, status_code=400)
        note(path="completions", prompt="ids" if isinstance(prompt, list) else "text", n=len(ids),
             max_tokens=body.get("max_tokens"))
        return answer(body, ids, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if (bad := refuse(body)) is not None:
            return bad
        text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        if body.get("add_generation_prompt", True) and not body.get("continue_final_message"):
            text += "<assistant>"
        note(path="chat", continued=bool(body.get("continue_final_message")), max_tokens=body.get("max_tokens"))
        return answer(body, [ord(c) for c in text], True)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')


def next_text(prompt: str, n: int) -> str:
    """The stand-in's answer to a completion of ``prompt``, ``n`` tokens (the model above)."""
    ids, out = [ord(c) for c in prompt], []
    for _ in range(n):
        out.append(97 + (sum(ids + out) * 7 + len(ids + out) * 13) % 26)
    return "".join(map(chr, out))


def chat_prompt(messages: list[dict]) -> str:
    """The stand-in's rendering of a chat, with the assistant's turn opened."""
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Stream:
    """One streamed answer as its client saw it: each data chunk's text, its ids, the error event if any."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: set[str] = set()
        self.error: dict | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.engines: str = ""

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def read(self, client: httpx.Client, url: str, body: dict) -> "Stream":
        """POST ``body`` (a stream) and read the answer whole; any failure is kept, not raised."""
        try:
            with client.stream("POST", url, json=body, timeout=300) as r:
                self.engines = r.headers.get("x-understudy-engine", "")
                if r.status_code != 200:
                    self.error = {"status": r.status_code, "body": r.read().decode(errors="replace")[:300]}
                    return self
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        self.error = c["error"]
                        continue
                    self.ids.add(c["id"])
                    for ch in c.get("choices") or ():
                        self.texts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                        self.finish_reason = ch.get("finish_reason") or self.finish_reason
                    if not c.get("choices"):
                        self.texts.append("")
        except httpx.HTTPError as e:  # (after an error event the router cuts the connection: that event is kept)
            self.error = self.error or {"transport": f"{type(e).__name__}: {e}"}
        return self

    @property
    def whole(self) -> bool:
        """Ended as an answer does: a finish_reason and [DONE], one response id, no error."""
        return self.error is None and self.done and self.finish_reason is not None and len(self.ids) == 1


def kill_mid_stream(h: Harness, bodies: list[dict]) -> tuple[list[Stream], dict]:
    """Send every body as a stream, SIGKILL the primary once each has had a few chunks, read them whole;
    returns the streams and the failover event."""
    old = h.primary()
    streams = [Stream() for _ in bodies]
    mark = len(h.events)
    with httpx.Client() as client, ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(s.read, client, h.router_url + ("/v1/chat/completions" if "messages" in b
                                                               else "/v1/completions"), b)
                   for s, b in zip(streams, bodies)]
        deadline = time.monotonic() + 60
        while not all(len(s.texts) >= 4 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(len(s.texts) >= 4 for s in streams), [len(s.texts) for s in streams]
        os.kill(old["pid"], signal.SIGKILL)
        for f in futures:
            f.result()
    ev = h.wait_event(lambda e: e["type"] == "failover", since=mark)
    assert ev["from"] == old["name"] and ev["reason"] == "exit"
    return streams, ev
