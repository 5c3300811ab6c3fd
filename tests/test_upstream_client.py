"""The router's lean HTTP client (supervisor/upstream.py) against raw-socket servers: a stream that
stalls mid-body times out, one cut mid-body is an error, and neither connection is reused."""
from __future__ import annotations

import asyncio

import pytest

from supervisor.upstream import Client, RemoteProtocolError, UpstreamTimeout

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNK = b"6\r\ndata: \r\n"


async def serve_then(after_first_chunk: str) -> tuple[asyncio.Server, str]:
    """A server answering every request with a head and one chunk, then stalling or closing."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + CHUNK)
        if after_first_chunk == "close":
            writer.close()
        else:
            await asyncio.sleep(5)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("after,error", [("stall", UpstreamTimeout), ("close", RemoteProtocolError)])
def test_a_stream_that_stalls_or_is_cut_mid_body_fails_and_is_not_pooled(after, error):
    async def go():
        server, url = await serve_then(after)
        client = Client(timeout_s=0.3)
        resp = await client.request("GET", url, b"/", [], b"")
        pieces = resp.stream()
        assert await pieces.__anext__() == b"data: "
        with pytest.raises(error):
            await pieces.__anext__()
        assert not any(o.idle for o in client._origins.values())  # dropped, never reused
        server.close()
    asyncio.run(go())
