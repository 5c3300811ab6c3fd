"""Block keys hashed in one place for three processes (wire/block_keys.py): the router's KeyChain
as a stream's ids come, the front end's check of the keys a failover's batch member carries, and
the wire that carries them (wire/batch_wire.py)."""
from __future__ import annotations

import random
from array import array

import numpy as np
import orjson
import pytest

from wire.batch_wire import BatchFormatError, encode_member, read_members
from wire.block_keys import DETERMINISTIC_ROOT, ROOT, KeyChain, checked_prompt_keys, prompt_keys
from supervisor.router.continuation import Tracked


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_chain_fed_in_pieces_has_the_keys_of_the_whole(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(50):
        prompt, output = array("q", (rng.randrange(1000) for _ in range(rng.randint(1, 70)))), array("q")
        chain = KeyChain(block_size)
        chain.catch_up(prompt, output)
        for _ in range(rng.randint(0, 12)):
            output.extend(rng.randrange(1000) for _ in range(rng.randint(0, 9)))
            chain.catch_up(prompt, output)
        whole = list(prompt) + list(output)
        assert chain.prompt(len(whole)) == prompt_keys(whole, ROOT, block_size)


def test_the_front_end_takes_the_routers_keys_only_when_they_are_its_own() -> None:
    ids = np.arange(100, 141, dtype=np.int64)  # 40 tokens before the last: 2 full blocks of 16
    mine = prompt_keys(ids, ROOT, 16)
    assert checked_prompt_keys(mine, ids, ROOT, 16) is mine
    assert checked_prompt_keys(None, ids, ROOT, 16) == mine
    assert checked_prompt_keys(mine[:-16], ids, ROOT, 16) == mine  # too few
    other_root = prompt_keys(ids, DETERMINISTIC_ROOT, 16)  # a deterministic engine's keys
    assert checked_prompt_keys(other_root, ids, ROOT, 16) == mine
    assert checked_prompt_keys(prompt_keys(ids, ROOT, 8)[:32], ids, ROOT, 16) == mine  # another block size
    assert checked_prompt_keys(b"", ids[:10], ROOT, 16) == b""  # no full block


def _engine_chunk(prompt: list[int] | None, ids: list[int]) -> bytes:
    c = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": None}]}
    if prompt is not None:
        c["choices"][0]["prompt_token_ids"] = prompt
    return b"data: " + orjson.dumps(c) + b"\n\n"


def test_a_tracked_stream_carries_its_keys_into_its_batch_member() -> None:
    prompt = list(range(200, 237))
    req = Tracked.parse("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 99, "stream": True},
                        key_chain=(ROOT, 16))
    req.feed(_engine_chunk(prompt, [1]))
    for i in range(30):
        req.feed(_engine_chunk(None, [2 + i]))
    (member,) = read_members(req.batch_member(b"/v1/completions"))
    whole = prompt + list(range(1, 32))
    assert member.keys == prompt_keys(whole, ROOT, 16) and len(member.keys) == 16 * 4
    assert member.prompt_ids.tolist() + member.output_ids.tolist() == whole
    bare = Tracked.parse("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True})
    bare.feed(_engine_chunk(prompt, [1]))
    assert read_members(bare.batch_member(b"/v1/completions"))[0].keys is None  # (no key chain: the engine hashes)


def test_a_member_without_keys_and_one_of_the_old_four_field_head_read_alike() -> None:
    ids = array("q", [5, 6, 7])
    old = b"/v1/completions 2 3 0\n{}" + ids.tobytes()
    new = encode_member(b"/v1/completions", b"{}", ids, array("q"))
    for body in (old, new):
        (m,) = read_members(body)
        assert m.prompt_ids.tolist() == [5, 6, 7] and m.keys is None


@pytest.mark.parametrize("head, what", [
    (b"/v1/completions 2 0 0 1\n{}", "keys need prompt ids"),
    (b"/v1/completions 2 1 0 -1\n{}", "none may be negative"),
    (b"/v1/completions 2 1 0 2\n{}" + bytes(8) + bytes(16), "bytes follow"),
    (b"/v1/completions 2 1 0 x\n{}", "not integers"),
])
def test_a_members_bad_key_count_is_refused_naming_the_member(head: bytes, what: str) -> None:
    with pytest.raises(BatchFormatError, match=what) as e:
        read_members(encode_member(b"/v1/completions", b"{}") + head)
    assert e.value.param.startswith("requests.1")
