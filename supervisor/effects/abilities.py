"""What an external engine can do, learned before it goes READY: the model id it reports on
``/v1/models`` (the canary, readiness and routing use it: no hand-set id), and the paths by which it can
continue a stream lost with another engine (supervisor/router/abilities.py), each tried once with a
one-token request."""
from __future__ import annotations

import json
from dataclasses import dataclass

from supervisor.router.abilities import Abilities
from supervisor.router.upstream import Client, UpstreamError


class ModelIdError(Exception):
    """``/v1/models`` answered, but not with one usable model id: the engine must not go READY."""


class NotAnswered(Exception):
    """``/v1/models`` did not answer (yet): the engine is still starting, or hangs."""


@dataclass(frozen=True)
class ReportedId:
    """The id an engine reports (``id``), or None with ``note`` saying why the configured one is used."""

    id: str | None
    note: str = ""


async def reported_model_id(client: Client, url: str, wanted: str | None, timeout_s: float) -> ReportedId:
    """The model id on the engine's ``/v1/models``: its one model, or ``wanted`` (model.name) among several.
    None (with a note) where the engine has no such route (404/405). Raises NotAnswered on a transport
    error, ModelIdError on anything else that is not a list of models with string ids."""
    try:
        status, body = await client.fetch("GET", url, "/v1/models", timeout_s=timeout_s)
    except UpstreamError as e:
        raise NotAnswered(f"/v1/models did not answer: {type(e).__name__}: {e}".rstrip(": ")) from None
    head = body[:120].decode(errors="replace")
    if status in (404, 405):
        return ReportedId(None, f"the engine reports no model id (GET /v1/models: HTTP {status})")
    if status != 200:
        raise ModelIdError(f"GET /v1/models answered HTTP {status}: {head!r}")
    try:
        data = json.loads(body)["data"]
        ids = [m["id"] for m in data]
        if not all(isinstance(i, str) and i for i in ids):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ModelIdError(f'GET /v1/models answered no model list: expected {{"data": [{{"id": ...}}]}}, '
                           f"got {head!r}") from None
    if len(ids) == 1:
        return ReportedId(ids[0])
    if wanted in ids:
        return ReportedId(wanted)
    if not ids:
        raise ModelIdError("GET /v1/models lists no model")
    raise ModelIdError(f"GET /v1/models lists {len(ids)} models ({', '.join(map(repr, ids[:4]))}"
                       f"{', ...' if len(ids) > 4 else ''}); set model.name to the one to serve")


async def learn_abilities(client: Client, url: str, model_id: str, prompt: str, timeout_s: float) -> Abilities:
    """Try each continuation path once (one token each): token ids (vLLM's ``return_token_ids`` and a
    prompt of ids), and a chat's final assistant message continued (``continue_final_message``)."""
    ids = await _takes_token_ids(client, url, model_id, prompt, timeout_s)
    chat = await _ok(client, url, "/v1/chat/completions", {
        "model": model_id, "max_tokens": 1, "temperature": 0.0, "stream": False,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "The"}],
        "continue_final_message": True, "add_generation_prompt": False}, timeout_s)
    return Abilities(model_id=model_id, token_ids=ids, chat_continue=chat is not None)


async def _takes_token_ids(client: Client, url: str, model_id: str, prompt: str, timeout_s: float) -> bool:
    base = {"model": model_id, "max_tokens": 1, "temperature": 0.0, "stream": False, "return_token_ids": True}
    answer = await _ok(client, url, "/v1/completions", {**base, "prompt": prompt}, timeout_s)
    try:
        choice = answer["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
        if not (isinstance(choice["token_ids"], list) and isinstance(prompt_ids, list) and prompt_ids
                and all(type(i) is int for i in prompt_ids)):
            return False
    except (TypeError, KeyError, IndexError):
        return False
    again = await _ok(client, url, "/v1/completions", {**base, "prompt": prompt_ids}, timeout_s)
    try:
        return isinstance(again["choices"][0]["token_ids"], list)
    except (TypeError, KeyError, IndexError):
        return False


async def _ok(client: Client, url: str, path: str, body: dict, timeout_s: float) -> dict | None:
    """The JSON answer of a 200, else None (refused, unknown fields, not JSON, no answer)."""
    try:
        status, answer = await client.fetch("POST", url, path, body, timeout_s)
        return json.loads(answer) if status == 200 else None
    except (UpstreamError, ValueError):
        return None
