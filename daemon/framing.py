"""Length-prefixed JSON frames over an AF_UNIX stream socket, with file descriptors (SCM_RIGHTS).

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one
object. File descriptors ride on the first byte of the frame. Never pickle: a peer can only ever
make us parse JSON of bounded size.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct

MAX_FRAME_BYTES = 1 << 20
MAX_FDS = 16
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """A frame could not be sent or received; the message is one line saying why."""


class PeerClosed(FrameError):
    """The peer closed the connection cleanly between two frames."""


def send_frame(sock: socket.socket, obj: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send `obj` as one JSON frame, passing `fds` (not closed here) with SCM_RIGHTS."""
    if not isinstance(obj, dict):
        raise FrameError(f"frame must be a JSON object, got {type(obj).__name__}")
    if len(fds) > MAX_FDS:
        raise FrameError(f"frame carries {len(fds)} fds, at most {MAX_FDS} allowed")
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte cap")
    data = _HEADER.pack(len(body)) + body
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict, list[int]]:
    """Receive one frame: (object, fds). The caller owns (and must close) the returned fds."""
    header, fds = _recv_header(sock)
    try:
        (length,) = _HEADER.unpack(header)
        if length == 0:
            raise FrameError("empty frame (length 0)")
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte cap")
        body = _recv_exact(sock, length)
        try:
            obj = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FrameError(f"frame body is not UTF-8 JSON: {str(e)[:80]}") from None
        if not isinstance(obj, dict):
            raise FrameError(f"frame must hold a JSON object, got {type(obj).__name__}")
        return obj, fds
    except BaseException:
        close_fds(fds)
        raise


def request(path: str | os.PathLike, obj: dict, timeout_s: float) -> dict:
    """One request on a fresh connection to an AF_UNIX server; fds in the reply are closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        sock.connect(os.fspath(path))
        send_frame(sock, obj)
        reply, fds = recv_frame(sock)
        close_fds(fds)
        return reply


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected AF_UNIX socket (SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def close_fds(fds: list[int]) -> None:
    """Close every fd in `fds`, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _recv_header(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds: list[int] = []
    got = b""
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(got) < _HEADER.size:
        data, ancdata, flags, _ = sock.recvmsg(_HEADER.size - len(got), cmsg_space,
                                               socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            close_fds(fds)
            raise FrameError(f"frame carried more than {MAX_FDS} fds (control data truncated)")
        if not data:
            close_fds(fds)
            if got:
                raise FrameError(f"connection closed inside a frame header ({len(got)} of 4 bytes)")
            raise PeerClosed("connection closed by peer")
        got += data
    return got, fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        k = sock.recv_into(view[pos:], n - pos)
        if k == 0:
            raise FrameError(f"connection closed inside a frame body ({pos} of {n} bytes)")
        pos += k
    return bytes(buf)
