"""The body of `POST /v1/continuations` (engines/frontend/continuation_batch.py): a failover's streams, each a
member framed as

    b"%s %d %d %d %d\\n" % (path, json_bytes, prompt_ids, output_ids, keys) + json + ids + keys

`json` is the member's request body as it would be sent alone, less its token ids; `ids` are the
`prompt_ids + output_ids` token ids of a continuation, as int64 little-endian. A member with no ids
(both counts 0) is its JSON as is (a request the failover re-sends before its first token); one with
ids continues from them (its JSON then holds no `continuation` of its own, and needs no prompt).
`keys` (16 bytes each; the count may be 0, or left out with its space) are the block keys of the
continuation's prompt as the router hashed them while the stream went (wire/block_keys.py
KeyChain): the front end takes them instead of hashing them itself when they are as many as the
prompt's full blocks and the first is its own (wire/block_keys.py `checked_prompt_keys`).

Why not JSON: a failover's batch carries ~1,000 ids a stream, 256 streams at once. As JSON numbers
they were most of what the new primary's front end did per continuation before its tokens could
flow (parsed, validated item by item, range-checked and packed again for hashing: ~90 of ~195 us a
member on the dev VM, bench/RESULTS.md); raw, they are read in place as one array each."""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_MEMBERS = 4096
# The answer's frames (engines/frontend/continuation_batch.py says what they carry), read by the router.
FRAMES_TYPE = b"application/x-understudy-frames"
BATCH_HEADER = b"x-understudy-batch"
END = 0  # a frame's status: the member's stream ended


class BatchFormatError(ValueError):
    """A body that is not a batch: says where (``param``, e.g. ``requests.3.path``) and what is wrong."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class WireMember:
    """One member as read: its path, its JSON (unparsed: a bad one is refused alone) and, for a
    continuation, its ids (int64 arrays over the body's bytes, not copied) and the router's keys."""

    path: str
    json: bytes
    prompt_ids: "np.ndarray | None"
    output_ids: "np.ndarray | None"
    keys: bytes | None = None  # its prompt's block keys as the router hashed them (checked by the front end)


def _little_endian(ids: array) -> array:
    """``ids`` as their int64 little-endian bytes read (the array itself on a little-endian host)."""
    if sys.byteorder == "little":
        return ids
    swapped = array(ids.typecode, ids)
    swapped.byteswap()
    return swapped


def encode_member(path: bytes, json: bytes, prompt_ids: array | None = None,
                  output_ids: array | None = None, keys: bytes = b"") -> bytes:
    """One member's frame (ids: `array('q')`, as the router keeps them; none: a request as is): one
    join of the parts, the ids' buffers read in place (no copy of each first)."""
    if prompt_ids is None:
        return b"%s %d 0 0 0\n" % (path, len(json)) + json
    output_ids = output_ids if output_ids is not None else array("q")
    head = b"%s %d %d %d %d\n" % (path, len(json), len(prompt_ids), len(output_ids), len(keys) // 16)
    return b"".join((head, json, _little_endian(prompt_ids), _little_endian(output_ids), keys))


def read_members(body: bytes) -> list[WireMember]:
    """The members of a batch's body, in order (BatchFormatError naming the first that is malformed)."""
    import numpy as np  # (here: the router imports this module to frame members, and starts without numpy)
    ids = np.dtype("<i8")
    members: list[WireMember] = []
    at, end = 0, len(body)
    while at < end:
        i = len(members)
        if i == MAX_MEMBERS:
            raise BatchFormatError(f"a batch holds at most {MAX_MEMBERS} members", "requests")
        nl = body.find(b"\n", at, at + 96)
        fields = body[at:nl].split(b" ") if nl >= 0 else []
        if len(fields) not in (4, 5):
            raise BatchFormatError(f"member {i}: expected a head 'PATH JSON_BYTES PROMPT_IDS OUTPUT_IDS [KEYS]' and "
                                   f"a newline at byte {at}", f"requests.{i}")
        path = fields[0].decode(errors="replace")
        if path not in PATHS:
            raise BatchFormatError(f"member {i}: path {path[:40]!r} is not one of {', '.join(PATHS)}",
                                   f"requests.{i}.path")
        try:
            size, n_prompt, n_output, n_keys = (int(x) for x in (*fields[1:], b"0")[:4])
        except ValueError:
            raise BatchFormatError(f"member {i}: its head's sizes are not integers: {body[at:nl][:96]!r}",
                                   f"requests.{i}") from None
        if min(size, n_prompt, n_output, n_keys) < 0 or ((n_output or n_keys) and not n_prompt):
            raise BatchFormatError(f"member {i}: sizes {size} {n_prompt} {n_output} {n_keys}: none may be negative, "
                                   f"and output ids and keys need prompt ids", f"requests.{i}")
        json_at, ids_at = nl + 1, nl + 1 + size
        keys_at = ids_at + 8 * (n_prompt + n_output)
        stop = keys_at + 16 * n_keys
        if stop > end:
            raise BatchFormatError(f"member {i}: its head says {stop - json_at} bytes follow; the body has "
                                   f"{end - json_at}", f"requests.{i}")
        prompt = output = None
        if n_prompt:
            prompt = np.frombuffer(body, ids, n_prompt, ids_at)
            output = np.frombuffer(body, ids, n_output, ids_at + 8 * n_prompt)
        members.append(WireMember(path, body[json_at:ids_at], prompt, output, body[keys_at:stop] if n_keys else None))
        at = stop
    if not members:
        raise BatchFormatError("a batch holds at least one member", "requests")
    return members
