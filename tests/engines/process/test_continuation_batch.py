"""`POST /v1/continuations` on a real engine process (tiny model, weights `off`): each member answers
as its own request would, byte for byte in its tokens (its ids framed raw, wire/batch_wire.py,
against the same continuation sent alone as JSON); a bad member gets its own refusal; a bad batch
is refused whole, naming what is wrong; one member is stopped by its abort, every member by the
router's leaving."""
from __future__ import annotations

import json
import socket
import threading
import time
from array import array

import httpx
import pytest

from wire.batch_wire import encode_member
from wire.block_keys import DETERMINISTIC_ROOT, ROOT, prompt_keys
from wire.engine_config import EngineConfig
from engines.frontend.continuation_batch import GROUP
from harness.engine_process import EngineProcess
from supervisor.router.http_wire import take_chunks

MAX_LEN = 512


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    cfg = EngineConfig(name="batch", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       weight_cache_mode="off", max_model_len=MAX_LEN, max_num_seqs=8)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(60)
    yield proc
    proc.stop()


def continued(model: str, prompt: list[int], done: list[int], max_tokens: int, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "seed": 5, **kw,
            "continuation": {"prompt_token_ids": prompt, "output_token_ids": done}}


def as_batch(*bodies: dict, path: str = "/v1/completions") -> bytes:
    """A batch's body as the router frames it: each body's continuation ids raw after its JSON."""
    out = []
    for body in bodies:
        body = dict(body)
        cont = body.pop("continuation", None)
        ids = (array("q", cont["prompt_token_ids"]), array("q", cont["output_token_ids"])) if cont else ()
        out.append(encode_member(path.encode(), json.dumps(body).encode(), *ids))
    return b"".join(out)


def post_batch(engine, body: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(engine.url + "/v1/continuations", content=body, timeout=timeout)


def frames(raw: bytes) -> dict[int, list[tuple[int, bytes]]]:
    """A batch body's frames by member: [(status, payload)]."""
    out: dict[int, list[tuple[int, bytes]]] = {}
    while raw:
        head, _, rest = raw.partition(b"\n")
        index, status, length = (int(x) for x in head.split(b" "))
        out.setdefault(index, []).append((status, rest[:length]))
        raw = rest[length:]
    return out


def token_ids(sse: bytes) -> list[int]:
    ids = []
    for line in sse.decode().splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                ids += ch.get("token_ids") or []
    return ids


def test_members_answer_as_their_own_requests_and_a_bad_one_alone_is_refused(engine, tiny_model):
    model = tiny_model.name
    a = continued(model, [5, 6, 7, 8, 9], [11, 12], 12)
    b = continued(model, list(range(20, 60)), [3], 8)
    bad = continued(model, [5, 6], [10 ** 9], 4)  # an id outside the vocabulary
    plain = {**a, "stream": False}
    fresh = {k: v for k, v in b.items() if k != "continuation"}  # re-sent before its first token: no ids
    body = as_batch(a, bad, b, plain, fresh)
    not_json = encode_member(b"/v1/completions", b"{oops")
    own_continuation = encode_member(b"/v1/completions", json.dumps(a).encode(), array("q", [5, 6]), array("q"))
    r = post_batch(engine, body + not_json + own_continuation)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-understudy-frames"
    got = frames(r.content)
    for i, body in ((0, a), (2, b), (4, fresh)):
        alone = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).content
        mine = b"".join(p for s, p in got[i] if s == 200)
        assert got[i][-1] == (0, b"") and mine.endswith(b"data: [DONE]\n\n")
        assert token_ids(mine) == token_ids(alone) and len(token_ids(mine)) == body["max_tokens"] - len(
            body.get("continuation", {}).get("output_token_ids", []))
    refusals = {i: json.loads(got[i][0][1])["error"] for i in (1, 3, 5, 6)}
    assert all(got[i] == [(400, got[i][0][1])] for i in refusals)
    assert "outside the vocabulary" in refusals[1]["message"] and "stream" in refusals[3]["message"]
    assert refusals[5]["message"].startswith("requests.5: request body is not valid JSON")
    assert refusals[6]["param"] == "requests.6.body.continuation"


def test_members_with_the_routers_block_keys_answer_as_their_own_requests(engine, tiny_model):
    """A member's block keys as the router hashed them (wire/batch_wire.py): the front end takes
    them when they are its own and hashes the prompt itself when not (another root, another count):
    each member's tokens are its own request's."""
    model = tiny_model.name
    prompt, done = list(range(30, 90)), [3, 4, 5]
    body = continued(model, prompt, done, 10)
    ids = prompt + done
    keys = {"its own": prompt_keys(ids, ROOT, 16), "another root": prompt_keys(ids, DETERMINISTIC_ROOT, 16),
            "too few": prompt_keys(ids, ROOT, 16)[:-16]}
    fields = json.dumps({k: v for k, v in body.items() if k != "continuation"}).encode()
    batch = b"".join(encode_member(b"/v1/completions", fields, array("q", prompt), array("q", done), k)
                     for k in keys.values())
    got = frames(post_batch(engine, batch).content)
    alone = token_ids(httpx.post(engine.url + "/v1/completions", json=body, timeout=60).content)
    for i in range(len(keys)):
        assert got[i][-1] == (0, b"") and token_ids(b"".join(p for s, p in got[i] if s == 200)) == alone


def test_members_past_the_first_group_answer_as_their_own_requests(engine, tiny_model):
    """More members than one group (GROUP go to the core in one message), a bad one at the boundary:
    every good member's tokens are its own request's."""
    model = tiny_model.name
    bodies = [continued(model, [7 + i % 50, 8, 9 + i % 7], [11], 4) for i in range(GROUP + 3)]
    bodies[GROUP] = continued(model, [5, 6], [10 ** 9], 4)
    got = frames(post_batch(engine, as_batch(*bodies), timeout=120).content)
    assert got[GROUP][0][0] == 400
    for i in (0, GROUP - 1, GROUP + 1, GROUP + 2):
        alone = httpx.post(engine.url + "/v1/completions", json=bodies[i], timeout=60).content
        mine = b"".join(p for s, p in got[i] if s == 200)
        assert got[i][-1] == (0, b"") and token_ids(mine) == token_ids(alone) and len(token_ids(mine)) == 3
    assert all(got[i][-1] == (0, b"") for i in range(len(bodies)) if i != GROUP)


@pytest.mark.parametrize("body, param, says", [
    (b"", "requests", "at least one member"),
    (b'{"requests": []}', "requests.0", "expected a head"),
    (b"/v1/embeddings 2 0 0\n{}", "requests.0.path", "is not one of"),
    (b"/v1/completions 2 0\n{}", "requests.0", "expected a head"),
    (b"/v1/completions 2 0 0\n{}/v1/completions two 0 0\n{}", "requests.1", "not integers"),
    (b"/v1/completions 2 -1 0\n{}", "requests.0", "none may be negative"),
    (b"/v1/completions 2 0 1\n{}" + bytes(8), "requests.0", "output ids and keys need prompt ids"),
    (b"/v1/completions 2 3 0\n{}" + bytes(16), "requests.0", "the body has 18"),
])
def test_a_malformed_batch_is_refused_naming_what_is_wrong(engine, body, param, says):
    r = post_batch(engine, body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and says in err["message"] and err["param"] == param, r.text


def test_the_wrong_method_is_refused(engine):
    assert httpx.get(engine.url + "/v1/continuations", timeout=30).status_code == 405


def running(engine) -> int:
    return httpx.get(engine.url + "/health", timeout=30).json()["running"]


def wait_idle(engine, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while running(engine):
        assert time.monotonic() < deadline, "the batch's sequences were not stopped"
        time.sleep(0.05)


def test_an_abort_stops_one_member_and_the_others_finish(engine, tiny_model):
    model = tiny_model.name
    long, short = continued(model, [5, 6, 7], [8], 400), continued(model, [9, 10, 11], [12], 30)
    with httpx.Client(timeout=60) as c, c.stream("POST", engine.url + "/v1/continuations",
                                                  content=as_batch(long, short)) as r:
        batch = r.headers["x-understudy-batch"]
        raw = b""
        stream = r.iter_bytes()
        while len(token_ids(b"".join(p for s, p in frames(raw).get(0, []) if s == 200))) < 3:
            raw += next(stream)
        assert c.post(engine.url + "/v1/continuations/abort", json={"batch": batch, "index": 0}).json() == \
            {"aborted": True}
        raw += b"".join(stream)  # the body ends once the short one has: the aborted one ends with no frame
    got = frames(raw)
    assert got[1][-1] == (0, b"") and len(token_ids(b"".join(p for s, p in got[1]))) == 29
    assert (0, b"") not in got[0] and len(token_ids(b"".join(p for s, p in got[0] if s == 200))) < 399
    wait_idle(engine)
    r = httpx.post(engine.url + "/v1/continuations/abort", json={"batch": batch, "index": 0}, timeout=30)
    assert r.status_code == 404 and "no batch" in r.json()["error"]["message"]


def test_an_abort_out_of_range_or_malformed_is_refused(engine, tiny_model):
    body = continued(tiny_model.name, [5, 6, 7], [8], 200)
    with httpx.Client(timeout=60) as c, c.stream("POST", engine.url + "/v1/continuations",
                                                  content=as_batch(body)) as r:
        batch = r.headers["x-understudy-batch"]
        r1 = c.post(engine.url + "/v1/continuations/abort", json={"batch": batch, "index": 3})
        r2 = c.post(engine.url + "/v1/continuations/abort", json={"batch": batch})
    assert r1.status_code == 400 and "no index 3" in r1.json()["error"]["message"]
    assert r2.status_code == 400
    wait_idle(engine)  # (the client left: every member stopped)


def test_a_flood_of_continuations_takes_its_turns_with_other_requests(engine, tiny_model):
    """Issue 52: a batch of 8x the slots' continuations, straight to the engine, puts at most the
    slots' worth ahead of everyone (a failover's all fit); its other members take turns with other
    requests as one request does, so another client is answered while most of the flood still waits."""
    model = tiny_model.name
    flood = as_batch(*(continued(model, [5 + i % 50, 6, 7], [8], 40) for i in range(64)))
    ends: list[float] = []  # when each member's last frame came

    def read_flood() -> None:
        raw = b""
        with httpx.Client(timeout=120) as c, c.stream("POST", engine.url + "/v1/continuations", content=flood) as r:
            for chunk in r.iter_bytes():
                raw += chunk
                while (head_end := raw.find(b"\n")) >= 0:  # (whole frames only: "index status length\n" payload)
                    _, status, length = (int(x) for x in raw[:head_end].split(b" "))
                    if len(raw) < head_end + 1 + length:
                        break
                    if status == length == 0:
                        ends.append(time.monotonic())
                    raw = raw[head_end + 1 + length:]
    reader = threading.Thread(target=read_flood)
    reader.start()
    while running(engine) < 8:
        time.sleep(0.005)
    other = httpx.post(engine.url + "/v1/completions", timeout=120,
                       json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    answered = time.monotonic()
    reader.join()
    assert other.status_code == 200 and len(ends) == 64
    before = sum(t < answered for t in ends)
    assert before <= 24, f"{before} of the flood's 64 members ended before another client's 2 tokens"


def generated(engine) -> int:
    time.sleep(1.0)  # (the front end's view of the core is a heartbeat late)
    return httpx.get(engine.url + "/health", timeout=30).json()["generated_tokens"]


def test_when_the_router_leaves_every_member_stops(engine, tiny_model):
    model = tiny_model.name
    members = as_batch(*(continued(model, [5 + i, 6, 7], [8], 500) for i in range(3)))
    before = generated(engine)
    with httpx.Client(timeout=60) as c, c.stream("POST", engine.url + "/v1/continuations", content=members) as r:
        next(r.iter_bytes())
    wait_idle(engine)
    assert generated(engine) - before < 3 * 499 // 2, "the members ran on after the router left"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_batch_is_refused_and_the_engine_serves_on(engine, tiny_model, chunked):
    """A batch over limits.max_body_bytes (8 MiB) gets a 413 naming the limit, by its length or as it
    arrives; the next request is served."""
    body = as_batch({"model": tiny_model.name, "prompt": "x" * (9 << 20), "stream": True})
    content = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
    r = post_batch(engine, content)
    assert r.status_code == 413 and "limits.max_body_bytes" in r.json()["error"]["message"], r.text
    ok = httpx.post(engine.url + "/v1/completions", timeout=60,
                    json={"model": tiny_model.name, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_slow_batch_body_holds_no_one_else_up(engine, tiny_model):
    """A batch whose body arrives over a second, in pieces: other requests are answered meanwhile,
    and the batch runs once its body is whole."""
    model = tiny_model.name
    member = continued(model, [5, 6, 7, 8], [9], 6)
    body = as_batch(member)
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/continuations HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-understudy-frames\r\n"
                  b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        for i in range(0, len(body) - 1, 40):  # the body but its last byte, over ~1 s
            s.sendall(body[i:min(i + 40, len(body) - 1)])
            time.sleep(1.0 / (len(body) // 40 + 1))
        meanwhile = httpx.post(engine.url + "/v1/completions", timeout=30,
                               json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert meanwhile.status_code == 200
        s.sendall(body[-1:])
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    if b"transfer-encoding: chunked" in head.lower():
        chunks, _, ended = take_chunks(rest)
        assert ended, "the batch's chunked body was cut short"
        rest = b"".join(chunks)
    got = frames(rest)
    mine = b"".join(p for st, p in got[0] if st == 200)
    assert got[0][-1] == (0, b"") and len(token_ids(mine)) == member["max_tokens"] - 1



def test_members_read_back_as_framed():
    """The router's frames (supervisor/router/continuation.py `batch_member`) read back member by
    member: paths, JSON, and ids as int64 arrays (the largest id of the widest vocabularies too)."""
    from wire.batch_wire import read_members
    big = array("q", [0, 2 ** 31 + 5, 151_935])
    body = (encode_member(b"/v1/chat/completions", b'{"a":1}', big, array("q", [7]))
            + encode_member(b"/v1/completions", b"{}") + encode_member(b"/v1/completions", b"[]", array("q", [3])))
    got = read_members(body)
    assert [(m.path, m.json) for m in got] == [("/v1/chat/completions", b'{"a":1}'), ("/v1/completions", b"{}"),
                                              ("/v1/completions", b"[]")]
    assert got[0].prompt_ids.tolist() == list(big) and got[0].output_ids.tolist() == [7]
    assert got[1].prompt_ids is None and got[2].prompt_ids.tolist() == [3] and got[2].output_ids.tolist() == []
