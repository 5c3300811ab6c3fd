"""OpenAI-compatible HTTP API over an LLMEngine: completions and chat completions (bare ASGI), models,
health, startup and metrics (FastAPI).

Every bad request gets an OpenAI-style error body `{"error": {"message", "type", "param", "code"}}`
naming the field; a client that goes away mid-request has its sequences aborted, nothing else.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Awaitable, Callable

import logging

import numpy as np
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .continuation_batch import BATCH_GROUP, Batch, BodyTiming, abort_member, serve_batch
from .engine_client import EngineClient
from wire import request_body
from wire.limits import LimitError, RequestLimits, check_body
from .first_output import FirstOutputLatency
from .metrics import render as render_metrics
from .prompts import chat_prompt_ids, completion_prompt_ids
from wire.protocol import (CONTINUED, AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                       CompletionChoice, CompletionRequest, CompletionResponse, ErrorBody, ErrorResponse, ModelCard,
                       ModelList, Usage)
from engines.core.sampling import SamplingParams, ensure_seed
from .streams import EventStream, RequestFailed, Running, StreamEvents
from engines.core.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("engines.frontend.server")


# A sequence to start: its prompt ids, sampling, how many of the ids a continuation replays, and the
# router's keys of its prompt's blocks (a failover's batch member; checked by EngineClient.submit).
Job = tuple["list[int] | np.ndarray", SamplingParams, int, "bytes | None"]


class APIError(Exception):
    """A request we refuse; becomes an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


class ResponseIds:
    """Response ids, unique across processes: a random prefix drawn once, then a counter (a uuid4 per
    request read the system's random source each time: 8% of the samples of a continuation's
    `completions` in a failover's batch, on the dev VM)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._n = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._n):016x}"


class OpenAIServer:
    """Binds the HTTP routes to one engine, its tokenizer and the served model name(s)."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_names: list[str], max_model_len: int,
                 vocab_size: int, startup_summary: Callable[[], dict], limits: RequestLimits | None = None,
                 deterministic: bool = False):
        self.engine, self.tokenizer, self.max_model_len = engine, tokenizer, max_model_len
        self.deterministic = deterministic  # said in /v1/models: the same request gives the same text
        self.limits = limits or RequestLimits()
        self.vocab_size = vocab_size  # the model's (embedding rows): every id fed to it must be below
        self.model_names = model_names
        self.startup_summary = startup_summary
        self.created = int(time.time())
        self.accepting = True
        self.first_output = FirstOutputLatency()
        self._ids = ResponseIds()
        self.batches: dict[str, Batch] = {}  # running batches of continuations, by id (engines/frontend/continuation_batch.py)

    # ---- request -> sequences --------------------------------------------------------------
    def _accept(self, name: str) -> None:
        """Refuse while draining (503) or for a model we do not serve (404)."""
        if not self.accepting:
            raise APIError(503, "engine is draining and takes no new requests", type_="service_unavailable",
                           code="draining")
        if name not in self.model_names:
            raise APIError(404, f"model {name!r} does not exist; this engine serves {self.model_names[0]!r}",
                           "model", code="model_not_found")

    def _params(self, req, prompt_len: int, param: str) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty (0 tokens)", param)
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; this model's context is {self.max_model_len} "
                                f"tokens, leaving no room to generate", param, code="context_length_exceeded")
        max_tokens = room if req.max_tokens is None else req.max_tokens
        if max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                                f"context of {self.max_model_len} tokens (at most {room} here)", "max_tokens",
                           code="context_length_exceeded")
        vocab = self.vocab_size
        for t in req.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise APIError(400, f"stop_token_ids holds {t}, outside the vocabulary 0..{vocab - 1}",
                               "stop_token_ids")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
                              ignore_eos=req.ignore_eos)

    def _check_ids(self, prompts: list[list[int]], param: str) -> None:
        vocab = self.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise self._outside_vocabulary(bad[0], param)

    def _start(self, jobs: list[Job]) -> Running:
        """Hand every (prompt, params, replayed, block keys) job to the core now."""
        running = Running(self.engine, len(jobs), self.first_output.submitted(), self.first_output)
        group = BATCH_GROUP.get() or id(running)  # its sequences (its batch's) take turns with other requests
        running.keys = [self.engine.submit(p, sp, lambda out, i=i: running.emit(i, out), group, r, keys)
                        for i, (p, sp, r, keys) in enumerate(jobs)]
        return running

    def _continued(self, req, cont, param: str) -> list[Job]:
        """The one job of a continuation: the original prompt's limits, minus the replayed tokens. Its
        ids are one int64 array (lists from JSON, or arrays read raw from a failover's batch): checked
        at once and sent to the core as they are, with the router's block keys of a batch member
        (EngineClient.submit checks them, or hashes the keys in place)."""
        try:
            prompt = np.asarray(cont.prompt_token_ids, dtype=np.int64)
            done = np.asarray(cont.output_token_ids, dtype=np.int64)
        except OverflowError:  # (an id past 64 bits)
            bad = next(t for t in (*cont.prompt_token_ids, *cont.output_token_ids) if not -2**63 <= t < 2**63)
            raise self._outside_vocabulary(bad, "continuation") from None
        ids = np.concatenate((prompt, done))
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise self._outside_vocabulary(int(ids[(ids < 0) | (ids >= self.vocab_size)][0]), "continuation")
        params = ensure_seed(self._params(req, len(prompt), param))
        if len(done) >= params.max_tokens:
            raise APIError(400, f"continuation.output_token_ids holds {len(done)} tokens: max_tokens="
                                f"{params.max_tokens} leaves nothing to generate", "continuation")
        params.max_tokens -= len(done)
        return [(ids, params, len(done), cont._router_keys)]

    def _outside_vocabulary(self, token: int, param: str) -> APIError:
        return APIError(400, f"prompt token id {token} is outside the vocabulary 0..{self.vocab_size - 1}", param)

    async def _whole(self, jobs: list) -> tuple[list[str], list[str | None], list[int], list[list[int]]]:
        """Run `jobs` to the end: each choice's text, finish reason, completion tokens and token ids
        (a whole answer's collection; a stream's events are made by StreamEvents); abort the rest on exit."""
        running = self._start(jobs)
        texts, reasons, completion = [""] * len(jobs), [None] * len(jobs), [0] * len(jobs)
        new_ids: list[list[int]] = [[] for _ in jobs]
        try:
            while running.live:
                await running.wait()
                for i, out in running.take():
                    running.accept(i, out)
                    texts[i] += out.delta
                    new_ids[i] += out.token_ids
                    reasons[i], completion[i] = out.finish_reason, out.completion_tokens
        finally:
            running.abort()  # the client went away (or we failed): free its slots
        return texts, reasons, completion, new_ids

    # ---- endpoints -------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest):
        self._accept(req.model)
        if req.continuation is not None:
            jobs = self._continued(req, req.continuation, "prompt")
            prompts = [req.continuation.prompt_token_ids]
        else:
            prompts = await completion_prompt_ids(self.tokenizer, req.prompt, req.n, self.limits, self.max_model_len)
            self._check_ids(prompts, "prompt")
            jobs = [(p, _nth_seed(ensure_seed(self._params(req, len(p), "prompt")), j), 0, None)
                    for p in prompts for j in range(req.n)]
        prompt_tokens = sum(len(p) for p in prompts)
        rid, created = f"cmpl-{self._ids.next()}", int(time.time())
        ids = req.return_token_ids
        prompt_of = [prompts[i // req.n] for i in range(len(jobs))]
        if req.stream:  # handed to the core before the response starts: the head costs it no time
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(StreamEvents(self._start(jobs), "completions", rid, created, req.model, prompt_tokens,
                                            include_usage, ids, prompt_of if ids and req.continuation is None else None))
        texts, reasons, completion, new_ids = await self._whole(jobs)
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                    prompt_token_ids=prompt_of[i] if ids else None,
                                    token_ids=new_ids[i] if ids else None) for i in range(len(jobs))]
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(completion),
                      total_tokens=prompt_tokens + sum(completion))
        resp = CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)
        return _json(resp.model_dump_json(exclude=None if ids else _CHOICE_IDS))

    async def chat_completions(self, req: ChatCompletionRequest):
        self._accept(req.model)
        if req.continuation is not None:
            prompt = req.continuation.prompt_token_ids
            jobs = self._continued(req, req.continuation, "messages")
        else:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
            try:
                prompt = await chat_prompt_ids(self.tokenizer, messages, req.n, self.limits, self.max_model_len)
            except ChatTemplateError as e:
                raise APIError(400, str(e), "messages") from None
            self._check_ids([prompt], "messages")
            params = ensure_seed(self._params(req, len(prompt), "messages"))
            jobs = [(prompt, _nth_seed(params, j), 0, None) for j in range(req.n)]
        rid, created = f"chatcmpl-{self._ids.next()}", int(time.time())
        ids = req.return_token_ids
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(StreamEvents(self._start(jobs), "chat", rid, created, req.model, len(prompt),
                                            include_usage, ids, [prompt] if ids and req.continuation is None else None))
        texts, reasons, completion, new_ids = await self._whole(jobs)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=texts[i]), finish_reason=reasons[i],
                              token_ids=new_ids[i] if ids else None) for i in range(len(jobs))]
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=sum(completion),
                      total_tokens=len(prompt) + sum(completion))
        resp = ChatCompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage,
                                      prompt_token_ids=prompt if ids else None)
        return _json(resp.model_dump_json(exclude=None if ids else {"prompt_token_ids": True, **_CHOICE_IDS}))

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_names[0], created=self.created,
                                         max_model_len=self.max_model_len, deterministic=self.deterministic)])


def build_app(srv: OpenAIServer) -> Callable[[dict, Callable, Callable], Awaitable[None]]:
    """The engine's ASGI app. The two generation endpoints (every request pays for this path) are
    bare ASGI, as the router is: their bodies are validated by pydantic directly and every error is
    answered in OpenAI's format, without FastAPI's routing, dependency solving and middleware (at
    one client on the dev VM they took 0.3 ms of the 0.5 ms from a request's arrival to the core).
    Everything else goes to the FastAPI app."""
    api = _fastapi_app(srv)
    hot = {"/v1/completions": (CompletionRequest, srv.completions),
           "/v1/chat/completions": (ChatCompletionRequest, srv.chat_completions)}
    limits = srv.limits

    async def start(path: str, data) -> Response:
        model, endpoint = hot[path]
        return await answer(path, data, model, endpoint, limits)

    async def batch(body: bytes, timing: BodyTiming) -> Response:
        return await serve_batch(body, start, error_response, srv.batches, srv.engine.together, timing)

    async def abort(body: bytes, _timing: BodyTiming) -> Response:
        out = abort_member(request_body.loads(body), srv.batches, error_response)
        return out if isinstance(out, Response) else JSONResponse(out)
    batched = {"/v1/continuations": batch, "/v1/continuations/abort": abort}  # (the router's, at failovers)

    async def app(scope: dict, receive, send) -> None:
        arrived = time.monotonic()
        path = scope["path"] if scope["type"] == "http" else None
        route, handler = hot.get(path), batched.get(path)
        if route is None and handler is None:
            await api(scope, receive, send)
        elif scope["method"] != "POST":
            resp = error_response(405, f"Method Not Allowed ({scope['method']} {scope['path']})")
            resp.headers["allow"] = "POST"
            await resp(scope, receive, send)
        elif route is not None:
            model, endpoint = route
            if (resp := await _generate(scope, receive, model, endpoint, limits)) is not None:
                await resp(scope, receive, send)
        elif (body := await read_whole_body(receive)) is not None:
            try:
                resp = await handler(body, BodyTiming(arrived, time.monotonic(), len(body)))
            except request_body.BodyError as e:
                resp = error_response(400, e.message, e.param, code=e.code)
            await resp(scope, receive, send)
    return app


async def _generate(scope: dict, receive, model, endpoint, limits: RequestLimits) -> Response | None:
    """One generation request: its body parsed, bounded and validated (wire/request_body.py),
    the endpoint's response or an OpenAI error (None: the client left before sending its body whole)."""
    body = await read_whole_body(receive)
    if body is None:
        return None
    try:
        data = request_body.loads(body)
    except request_body.BodyError as e:
        return error_response(400, e.message, e.param, code=e.code)
    return await answer(scope["path"], data, model, endpoint, limits)


async def read_whole_body(receive) -> bytes | None:
    """The request's body (None: the client left before sending it whole)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def answer(path: str, data, model, endpoint, limits: RequestLimits) -> Response:
    """The endpoint's response to a parsed generation request, or its OpenAI error."""
    try:
        check_body(limits, data, model is ChatCompletionRequest)
        if isinstance(data, dict) and data.get("continuation") is not None:  # (its prompt may be left out)
            model = CONTINUED[model]
        req = request_body.validate(model, data)
    except request_body.BodyError as e:
        return error_response(400, e.message, e.param, code=e.code)
    except LimitError as e:
        return JSONResponse(e.body(), status_code=e.status)
    try:
        return await endpoint(req)
    except APIError as e:
        return error_response(e.status, e.message, e.param, e.type, e.code)
    except LimitError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except RequestFailed as e:
        (log.error if e.status == 500 else log.info)("request to %s failed: %s", path, e)
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:  # noqa: BLE001 (answered, logged; the engine goes on)
        return _internal_error(path, e)


def _internal_error(path: str, e: Exception) -> JSONResponse:
    log.exception("request to %s failed", path)
    return error_response(500, f"internal error: {type(e).__name__}: {e}", type_="internal_error")


def _fastapi_app(srv: OpenAIServer) -> FastAPI:
    """Models, health, startup, metrics, and OpenAI-format errors for every other path."""
    app = FastAPI(title="understudy engine", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (unknown path 404, wrong method 405), OpenAI-style."""
        resp = error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})",
                              code="not_found" if exc.status_code == 404 else None)
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request.url.path, exc)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return srv.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = srv.engine.alive()
        body = {"status": "ok" if ok else "scheduler loop stalled", **srv.engine.stats(),
                "draining": not srv.accepting}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/startup")
    async def startup() -> dict:
        return srv.startup_summary()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(srv.engine.stats()) + srv.first_output.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


_CHOICE_IDS = {"choices": {"__all__": {"prompt_token_ids": True, "token_ids": True}}}


def _json(body: str) -> Response:
    """A response already serialised (so extension fields the client did not ask for can be left out)."""
    return Response(body, media_type="application/json")


def _nth_seed(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of a seeded request uses seed+j: n choices differ, yet each is reproducible."""
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + j)
