"""`cpu` transport: the arena is a memfd, sealed against writes once loaded; clients map it PROT_READ."""
from __future__ import annotations

import fcntl
import mmap
import os
import warnings

import torch

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class CpuArena:
    """A writable memfd region for the daemon to fill; `finish()` unmaps it and seals the fd."""

    transport = "cpu"

    def __init__(self, size: int, name: str = "understudy-arena") -> None:
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        # MAP_POPULATE: allocate and map every page now, so the load is not slowed by page faults
        self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.region: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def export_fd(self) -> int:
        """The fd to pass to clients (stays owned by this object)."""
        return self.fd

    def finish(self) -> None:
        """Drop the writable mapping and seal the memfd: from now on nobody can change a byte.

        Every tensor over `region` must be gone first (a live writable mapping blocks the seal).
        """
        self.region = None
        try:
            self._map.close()
        except BufferError:
            raise RuntimeError("cannot seal the cpu arena: tensors over its writable mapping are still alive") from None
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    def close(self) -> None:
        """Release the daemon's fd and mapping (clients' mappings stay valid)."""
        self.region = None
        if not self._map.closed:
            self._map.close()
        os.close(self.fd)


def map_readonly(fd: int, size: int) -> tuple[torch.Tensor, mmap.mmap]:
    """Map a sealed arena memfd PROT_READ: (uint8 tensor over it, the mapping to keep alive)."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if not seals & fcntl.F_SEAL_WRITE:
        raise RuntimeError("cpu arena fd is not sealed against writes: refusing a possibly partial arena")
    actual = os.fstat(fd).st_size
    if actual < size:
        raise RuntimeError(f"cpu arena fd holds {actual} bytes, the manifest needs {size}")
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": that is the point
        region = torch.frombuffer(m, dtype=torch.uint8)
    return region, m


def map_shared(fd: int, size: int) -> tuple[torch.Tensor, mmap.mmap]:
    """Map a KV pool memfd read-write and shared: (uint8 tensor over it, the mapping to keep alive)."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise RuntimeError(f"cpu KV pool fd holds {actual} bytes, the layout needs {size}")
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(m, dtype=torch.uint8), m


def sealed_blob(data: bytes, name: str = "understudy-manifest") -> int:
    """A sealed memfd holding `data` (for payloads larger than a frame, e.g. big manifests)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    return fd


def read_blob(fd: int, max_bytes: int = 1 << 30) -> bytes:
    """All bytes of a sealed memfd from `sealed_blob`."""
    if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
        raise RuntimeError("blob fd is not sealed against writes")
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise RuntimeError(f"blob of {size} bytes exceeds the {max_bytes}-byte limit")
    return os.pread(fd, size, 0)
