"""One continuable request as the router sees it: what the client asked for, and what it has been
sent so far (prompt ids, emitted ids, text), read from the engine's event stream.

The router always asks the engine for a stream with token ids (`stream: true`,
`return_token_ids: true`, a seed), whatever the client asked; it gives the client the shape it
asked for (a stream without the extension fields it did not ask for, or one whole response). When
the primary is lost, `upstream_body()` is the continuation for the new one: the original request,
its prompt (or messages) replaced by `continuation: {prompt_token_ids, output_token_ids}`
(wire/protocol.py `ContinuedCompletion`, `ContinuedChat`), whose stream is spliced in (same id
and `created`, its chat role chunk dropped). An external engine gets the client's request as a stream
(with `return_token_ids` where it takes them) and its continuation by the path it takes
(supervisor/router/abilities.py): prompt ids + ids sent, or a replay of the text sent.

Every engine chunk is a consistent snapshot (engines/core/sequence.py Output): its ids are all the
tokens generated up to it, its text all the text released up to it; ids are recorded only from
chunks handled whole, so a replay always matches the text the client has.

A stream's ids are kept where the garbage collector does not walk them: in an `array` (one object,
not one int object per id), and a client's prompt of ids as a pre-serialised `orjson.Fragment`. A
collection of the router's process walks every list item of every stream in flight and stops every
stream meanwhile; on an H200 host at 256 streams the collections cost a third to a half less this way
(bench/RESULTS.md, 2026-12-04).
"""
from __future__ import annotations

import random
import re
import time
from array import array
from typing import Any

import orjson

from wire import request_body, sse
from wire.batch_wire import encode_member
from wire.block_keys import KeyChain
from supervisor.router.abilities import Abilities

PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_IDS = ("prompt_token_ids", "token_ids")
# The extension fields as the engine writes them (compact JSON). A literal `,"` never occurs inside
# a JSON string (its quote would be escaped), so this cannot cut into text.
_STRIP = re.compile(rb',"(?:prompt_)?token_ids":(?:\[[\d,]*\]|null)')


_SCHEDULED = sse.SCHEDULED.rstrip(b"\n")  # the engine's marker: it began running the request
_SEEDS = random.Random()  # seeded from os.urandom once: no system call per request, as secrets makes


def _dump(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _ids(values: Any) -> array:
    """Token ids as the router keeps them (out of the garbage collector's walk)."""
    return array("q", values)


def _ids_json(ids: array | None) -> orjson.Fragment | None:
    return None if ids is None else orjson.Fragment(orjson.dumps(ids.tolist()))


def _kept_prompt(req: dict) -> None:
    """A prompt of token ids, pre-serialised: the same JSON on the wire, one untracked object here."""
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 16 and all(type(x) is int for x in prompt):  # (short: cheap to walk)
        try:
            req["prompt"] = orjson.Fragment(orjson.dumps(prompt))
        except orjson.JSONEncodeError:  # (an int past 64 bits: sent on as it came, for the engine to refuse)
            pass


def _as_json(value: Any) -> Any:
    """A Fragment back as what it holds (to show a body as the client sent it; a Fragment's bytes are
    not readable back but through dumps)."""
    return orjson.loads(orjson.dumps(value)) if isinstance(value, orjson.Fragment) else value


def parse_request(path: str, body: bytes) -> Any:
    """The JSON body of a generation request, parsed once for the router's limits and tracking,
    with the cyclic GC paused as the engine does (wire/request_body.py: a body of a million
    small lists otherwise sets off hundreds of collections); None for other paths and for a body
    that is not JSON (nesting too deep included): such a body passes through, and the engine names
    what is wrong with it."""
    if path not in PATHS:
        return None
    try:
        return request_body.loads(body)
    except request_body.BodyError:
        return None


class Tracked:
    """A request the router can continue on another engine."""

    def __init__(self, kind: str, req: dict, max_ids: int = 1 << 62, arrived: float | None = None,
                 key_chain: tuple[bytes, int] | None = None, keep_text: bool = False) -> None:
        """``key_chain``: the engines' block keys' (key root, block size): the stream's block keys are
        then hashed as its ids come, for a failover's batch (wire/block_keys.py KeyChain). ``keep_text``
        (external engines): the text sent is kept for a replay, and a chunk of text without ids counts
        as one token (an engine may join tokens in a chunk: a lower bound)."""
        self.kind, self.req, self.max_ids, self.keep_text = kind, req, max_ids, keep_text
        self._key_chain, self.keys = key_chain, None
        self.arrived = time.monotonic() if arrived is None else arrived  # when the router received it
        self.client_stream = bool(req.get("stream"))
        self.client_ids = bool(req.get("return_token_ids"))
        opts = req.get("stream_options")
        self.include_usage = self.client_stream and isinstance(opts, dict) and bool(opts.get("include_usage"))
        self._seed_drawn = req.get("seed") is None  # by the router (the client sent none, or null)
        self._seed_null = self._seed_drawn and "seed" in req
        if self._seed_drawn:  # the draw is a function of (seed, position): fix it now
            req["seed"] = _SEEDS.getrandbits(63)
        _kept_prompt(req)
        self.rid: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.prompt_ids: array | None = None
        self.output_ids = _ids(())
        self.n_output = 0  # generated tokens so far (output_ids is dropped past max_ids)
        self.overflow = False  # too long to replay: ids no longer kept (unless the client wants them)
        self.text: list[str] = []  # for a client that wants one whole response, or a replay by text
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.role_sent = False
        self.done = False  # [DONE] seen
        self.progress = False  # new token ids since the flag was last cleared
        self.ran = False  # the engine of this attempt began running it (its scheduled marker, or a token)
        self.chunks_sent = 0  # data chunks given to a streaming client
        self._buf = b""

    @classmethod
    def parse(cls, path: str, req: Any, max_ids: int = 1 << 62, arrived: float | None = None,
              key_chain: tuple[bytes, int] | None = None, keep_text: bool = False) -> "Tracked | None":
        """A Tracked for a request (its body as `parse_request` read it) the router can continue
        exactly, else None (passed through as is: not JSON, n > 1, several prompts, a continuation
        already, odd types the engine will refuse)."""
        kind = PATHS.get(path)
        if kind is None or not isinstance(req, dict) or "continuation" in req or req.get("n", 1) != 1 \
                or req.get("best_of") not in (None, 1):
            return None
        if not all(isinstance(req.get(k, False), bool) for k in ("stream", "return_token_ids")):
            return None
        if not isinstance(req.get("seed"), (int, type(None))) or isinstance(req.get("seed"), bool):
            return None
        prompt = req.get("prompt")
        if kind == "completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
                and len(prompt) != 1:
            return None
        return cls(kind, req, max_ids, arrived, key_chain, keep_text)

    @property
    def replay_tokens(self) -> int:
        return len(self.prompt_ids or ()) + self.n_output

    def upstream_body(self, ab: Abilities | None = None) -> bytes:
        """What to send the engine: the request as a stream with ids; a continuation once the
        prompt ids are known (from the first chunk). ``ab``: an external engine's abilities."""
        if ab is not None:
            return _dump(self._external_fields(ab))
        body = self._upstream_fields()
        if self.prompt_ids is not None:
            body["continuation"] = {"prompt_token_ids": _ids_json(self.prompt_ids),
                                    "output_token_ids": _ids_json(self.output_ids)}
        return _dump(body)

    def batch_member(self, path: bytes) -> bytes:
        """``upstream_body()`` as a member of a failover's batch (wire/batch_wire.py): the same
        request, its continuation's ids framed raw after its JSON."""
        keys = self.keys.prompt(len(self.prompt_ids) + len(self.output_ids)) if self.keys is not None else b""
        return encode_member(path, _dump(self._upstream_fields()), self.prompt_ids, self.output_ids, keys)

    def _upstream_fields(self) -> dict:
        """The client's fields as the engine gets them: a stream with ids; once the prompt ids are
        known (from the first chunk), without the client's prompt (the continuation carries it)."""
        body = {**self.req, "stream": True, "return_token_ids": True}
        if not self.client_stream:
            body.pop("stream_options", None)
        if self.prompt_ids is not None:
            body.pop("messages" if self.kind == "chat" else "prompt", None)
        return body

    def _external_fields(self, ab: Abilities) -> dict:
        """The client's request for an external engine (a stream, its model id), or once tokens were sent
        its continuation: prompt ids + ids sent where the engine takes ids, else the text sent replayed
        (completions: after the prompt; chat: as the assistant's message to continue), for the tokens left."""
        body = {**self.req, "stream": True, "model": ab.model_id}
        if self._seed_drawn:  # (a seed of ours means nothing to another engine's sampler)
            body.pop("seed", None)
        if not self.client_stream:
            body.pop("stream_options", None)
        if ab.token_ids and self.kind == "completions":  # (a chat is replayed by text: no ids needed)
            body["return_token_ids"] = True
        if not self.n_output:
            return body
        for key in ("max_tokens", "max_completion_tokens"):
            if type(body.get(key)) is int:
                body[key] = max(1, body[key] - self.n_output)
        sent = "".join(self.text)
        if self.kind == "completions":
            if self._ids_continue(ab):
                body["prompt"] = orjson.Fragment(orjson.dumps(self.prompt_ids.tolist() + self.output_ids.tolist()))
            else:
                body["prompt"] = (self._prompt_text() or "") + sent
            return body
        messages = list(body.get("messages") or ())
        if self.req.get("continue_final_message") and messages and isinstance(messages[-1].get("content"), str):
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + sent}
        else:
            messages.append({"role": "assistant", "content": sent})
        body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        return body

    def _ids_continue(self, ab: Abilities) -> bool:
        """The engine takes ids and this request's ids are all kept: the exact continuation."""
        return ab.token_ids and self.prompt_ids is not None and not self.overflow

    def _prompt_text(self) -> str | None:
        """A completion's prompt as text (a string, or a list of one), else None (token ids)."""
        prompt = self.req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    def not_continuable(self, ab: Abilities | None) -> str | None:
        """Why an external engine cannot continue this request now (None: it can, or it is ours)."""
        if ab is None or not self.n_output:
            return None
        if self.kind == "completions":
            if self._ids_continue(ab):
                return None
            if self._prompt_text() is None:
                return "its prompt is token ids, and the engine does not return token ids (return_token_ids)"
            return None
        if not ab.chat_continue:
            return ("the engine does not continue a partial assistant message (continue_final_message), so a chat "
                    "stream cannot be replayed there")
        if not all(isinstance(m, dict) for m in self.req.get("messages") or ()):
            return "its messages are not objects"
        return None

    def in_client_terms(self, error: bytes) -> bytes:
        """An engine's refusal (its JSON error body) of ``upstream_body()``, in terms of the body the
        client sent: where the message shows the whole body (a missing field's error,
        wire/request_body.py `preview`), it shows the client's fields, not the seed, `stream`,
        `return_token_ids` and `continuation` the router set. Anything else is returned as it came."""
        try:
            err = orjson.loads(error)
            message = err["error"]["message"]
            if not isinstance(message, str):
                return error
            own = {k: _as_json(v) for k, v in self.req.items()}
            if self._seed_null:
                own["seed"] = None
            elif self._seed_drawn:
                del own["seed"]
            mine = message.replace(request_body.preview(orjson.loads(self.upstream_body())), request_body.preview(own))
        except (ValueError, KeyError, TypeError):
            return error
        if mine == message:
            return error
        err["error"]["message"] = mine
        return _dump(err)

    # ---- the engine's stream --------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """Take bytes of the engine's event stream; return what to send a streaming client."""
        self._buf += data
        if b"\n\n" not in self._buf:
            return b""
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for event in events:
            if event.startswith(b"data: "):
                if (piece := self._event(event[6:])) is not None:
                    out.append(piece)
            elif event == _SCHEDULED:  # (other comments: a handoff's end, keep-alives)
                self.ran = True
        return b"".join(out)

    def _event(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            self.done = True
            return sse.DONE if self.client_stream else None
        c = orjson.loads(payload)
        if self.rid is None:
            self.rid, self.created, self.model = c.get("id"), c.get("created"), c.get("model")
        same = c.get("id") == self.rid and c.get("created") == self.created  # not a continuation's chunk
        if not same:
            c["id"], c["created"] = self.rid, self.created
        prompt = c.get("prompt_token_ids")
        role = False
        for ch in c.get("choices") or ():
            prompt = prompt or ch.get("prompt_token_ids")
            if self.kind == "chat":
                delta = ch.get("delta") or {}
                text, role = delta.get("content") or "", bool(delta.get("role"))
            else:
                text = ch.get("text") or ""
            if ids := ch.get("token_ids"):
                self.n_output += len(ids)
                self.progress = self.ran = True
                if not self.overflow:
                    self.output_ids.extend(ids)
                    if self.replay_tokens > self.max_ids and not (self.client_ids and not self.client_stream):
                        self.overflow, self.output_ids = True, _ids(())  # memory stays bounded
            elif text and self.keep_text:  # (an engine without ids: a chunk is a token at least)
                self.n_output += 1
                self.progress = self.ran = True
            if not self.client_stream or self.keep_text:
                self.text.append(text)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = _ids(prompt)
            if self._key_chain is not None:
                root, block_size = self._key_chain
                self.keys = KeyChain(block_size, root)
        if self.keys is not None:
            if self.overflow:
                self.keys = None
            else:
                self.keys.catch_up(self.prompt_ids, self.output_ids)
        if c.get("usage"):
            self.usage = c["usage"]
        if not self.client_stream or (role and self.role_sent):  # a continuation's role chunk
            return None
        self.role_sent = self.role_sent or role
        self.chunks_sent += 1
        if same:  # the engine's own bytes, less what the client did not ask for
            out = payload if self.client_ids else _STRIP.sub(b"", payload)
            if self.client_ids or b'token_ids"' not in out:  # (else not compact JSON: re-serialise)
                return b"data: " + out + b"\n\n"
        if not self.client_ids:
            c.pop("prompt_token_ids", None)
            for ch in c.get("choices") or ():
                for k in _IDS:
                    ch.pop(k, None)
        return b"data: " + _dump(c) + b"\n\n"

    # ---- endings made by the router -------------------------------------------------------------
    def _usage(self) -> dict:
        p, n = len(self.prompt_ids or ()), self.n_output
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def finish_locally(self) -> bytes:
        """The engine died after its last token's chunk: the rest of the stream (usage, [DONE])."""
        out = b""
        if self.include_usage and self.usage is None:
            obj = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
            out += b"data: " + _dump({"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                                      "choices": [], "usage": self._usage()}) + b"\n\n"
        return out + sse.DONE

    def whole_response(self) -> bytes:
        """The one JSON response a non-streaming client asked for, from the spliced stream."""
        text = "".join(self.text)
        if self.kind == "completions":
            choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            if self.client_ids:
                choice.update(prompt_token_ids=_ids_json(self.prompt_ids), token_ids=_ids_json(self.output_ids))
            obj: dict = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                         "choices": [choice], "usage": self._usage()}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
            if self.client_ids:
                choice["token_ids"] = _ids_json(self.output_ids)
            obj = {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                   "choices": [choice], "usage": self._usage()}
            if self.client_ids:
                obj["prompt_token_ids"] = _ids_json(self.prompt_ids)
        return _dump(obj)


def error_event(message: str, type_: str, code: int) -> bytes:
    """An SSE error event (as OpenAI's client reads it) telling a streaming client its answer is cut."""
    return b"data: " + _dump({"error": {"message": message, "type": type_, "code": code}}) + b"\n\n"
