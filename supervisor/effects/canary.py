"""Semantic readiness: a fixed greedy completion through the engine's real HTTP path, compared
with the golden answer recorded for this fingerprint (the first engine to pass records it)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.router.upstream import Client, UpstreamError


@dataclass
class CanaryResult:
    ok: bool
    text: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    broken: bool = False  # the engine answered that its model cannot serve (e.g. non-finite logits)
    model_id: str | None = None  # an external engine's model id, as it reported it


async def run_canary(client: Client, url: str, model: str, prompt: str, max_tokens: int,
                     timeout_s: float) -> CanaryResult:
    """POST /v1/completions (greedy); ok=False with an error on any transport or format problem."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    try:
        status, answer = await client.fetch("POST", url, "/v1/completions", body, timeout_s)
    except UpstreamError as e:
        return CanaryResult(False, error=f"{type(e).__name__}: {e}".rstrip(": "))
    text_head = answer[:200].decode(errors="replace")
    if status != 200:
        return CanaryResult(False, error=f"HTTP {status}: {text_head}", broken=_says_broken(status, answer))
    try:
        choice = json.loads(answer)["choices"][0]
        text = choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return CanaryResult(False, error=f"unexpected completion body: {text_head}")
    ids = choice.get("token_ids")
    return CanaryResult(True, text=text, token_ids=ids if isinstance(ids, list) else None)


def _says_broken(status: int, body: bytes) -> bool:
    """A 500 whose OpenAI error says sampling failed: the model is broken, not still starting."""
    try:
        return status == 500 and json.loads(body)["error"]["code"] == "sampling_error"
    except (ValueError, KeyError, TypeError):
        return False


async def is_listening(client: Client, url: str) -> bool:
    """Whether the engine's HTTP server answers (/health, else /v1/models)."""
    for path in ("/health", "/v1/models"):
        try:
            status, _ = await client.fetch("GET", url, path, timeout_s=2.0)
        except UpstreamError:
            return False
        if status == 200:
            return True
        if status != 404:
            return False
    return False


def model_fingerprint(model_path: str, **fields: Any) -> str:
    """Key for golden answers: the checkpoint files' identity (name, size, mtime, inode) plus the
    settings that change the numbers (dtype, tp, device, canary prompt)."""
    h = hashlib.sha256()
    root = Path(model_path)
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\n".encode())
    h.update(json.dumps({"model_path": str(root.resolve()) if root.exists() else model_path, **fields},
                        sort_keys=True).encode())
    return h.hexdigest()[:24]


class GoldenStore:
    """``{runtime_dir}/golden/{fingerprint}.json`` (0600, atomic)."""

    def __init__(self, runtime_dir: Path) -> None:
        self.dir = runtime_dir / "golden"
        self.dir.mkdir(mode=0o700, exist_ok=True)

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / f"{key}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def record(self, key: str, result: CanaryResult, engine: str,
               provenance: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record the golden answer unless another engine did first; returns the stored one.

        ``provenance`` says where the recording engine's weights came from: ``weights_finite``
        (its load was checked finite) and ``content_digest`` (the checkpoint bytes' hash). A golden
        is trusted only when both sources agree with the weights now served: one recorded from an
        unchecked load, or for other bytes at the same path, is replaced by a checked one."""
        existing = self.get(key)
        prov = provenance or {}
        if existing is not None and not _superseded(existing, prov):
            return existing
        data = {"text": result.text, "token_ids": result.token_ids, "recorded_by": engine, **prov}
        if result.model_id is not None:
            data["model_id"] = result.model_id
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.dir / f"{key}.json")
        return data


def weights_provenance(facts: dict[str, Any], source: str | None) -> dict[str, Any]:
    """Whether the engine's weights were checked finite, and their content digest: a cache hit maps
    the daemons' arenas (each checked when loaded); a disk load is checked by the engine itself
    (engines/process/weights.py: it exits 3 otherwise); external engines are not checked. ``facts``:
    supervisor/core/engine_health.py weights_facts."""
    src, digest = source or "", None
    daemons = facts.get("daemons") or []
    if src.startswith("cache_hit"):
        finite = bool(daemons) and all(d.get("weights_finite") is True for d in daemons)
        digest = next(((d.get("fingerprint") or {}).get("content_digest") for d in daemons if d.get("fingerprint")),
                      None)
    else:
        finite = True if src.startswith("disk") and not facts.get("external") else None
    return {"weights_source": src or None, "weights_finite": finite, "content_digest": digest}


def _superseded(golden: dict[str, Any], prov: dict[str, Any]) -> bool:
    if prov.get("weights_finite") is not True:
        return False  # an unchecked load never replaces anything
    if golden.get("weights_finite") is not True:
        return True
    digest, recorded = prov.get("content_digest"), golden.get("content_digest")
    return digest is not None and recorded is not None and digest != recorded


def compare(golden: dict[str, Any], result: CanaryResult) -> str | None:
    """None if the canary matches the golden answer, else a one-line reason."""
    if golden.get("model_id") is not None and result.model_id is not None and golden["model_id"] != result.model_id:
        return (f"model id changed: the engine reports {result.model_id!r} on /v1/models, the node served "
                f"{golden['model_id']!r} (a restart must serve the same model)")
    if golden.get("token_ids") is not None and result.token_ids is not None:
        if golden["token_ids"] != result.token_ids:
            return f"canary mismatch: expected token ids {golden['token_ids']}, got {result.token_ids}"
        return None
    if golden.get("text") != result.text:
        return f"canary mismatch: expected {golden.get('text')!r}, got {result.text!r}"
    return None
