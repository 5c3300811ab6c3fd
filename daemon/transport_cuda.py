"""`cuda` transport: the arena is one CUDA VMM allocation exported as a POSIX fd (cuda-bindings).

The daemon maps it read-write to fill it; clients import the fd, map it and set access to
read-only, so a stray write from an engine faults instead of corrupting the shared weights.
Tested only on a GPU host (tests marked `gpu`, `python -m daemon.gpu_check`).
"""
from __future__ import annotations

import torch



def _cu():
    from cuda.bindings import driver as cu

    return cu


def _check(result):
    """Unwrap a cuda-bindings return tuple, raising on any error code."""
    cu = _cu()
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def use_primary_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    cu = _cu()
    torch.cuda.set_device(device_index)
    torch.cuda.init()
    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(device_index))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev))
    _check(cu.cuCtxSetCurrent(ctx))


def _prop(device_index: int):
    cu = _cu()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _access(device_index: int, read_only: bool):
    cu = _cu()
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                  else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return desc


class _Mapping:
    """A VMM handle mapped at a reserved address; `as_tensor()` wraps it without a copy."""

    def __init__(self, handle, size: int, device_index: int, read_only: bool) -> None:
        cu = _cu()
        self.handle, self.size, self.device_index = handle, size, device_index
        self.ptr = _check(cu.cuMemAddressReserve(size, 0, 0, 0))
        _check(cu.cuMemMap(self.ptr, size, 0, handle, 0))
        _check(cu.cuMemSetAccess(self.ptr, size, [_access(device_index, read_only)], 1))

    def as_tensor(self) -> torch.Tensor:
        ptr, size = int(self.ptr), self.size

        class _Iface:  # the tensor keeps this object, and through it the mapping, alive
            __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                        "version": 3, "strides": None}
            owner = self

        return torch.as_tensor(_Iface(), device=f"cuda:{self.device_index}")

    def close(self) -> None:
        """Unmap and release (only once no tensor over the mapping is used again)."""
        cu = _cu()
        _check(cu.cuMemUnmap(self.ptr, self.size))
        _check(cu.cuMemAddressFree(self.ptr, self.size))
        _check(cu.cuMemRelease(self.handle))


def round_up(size: int, device_index: int) -> int:
    """`size` rounded up to the VMM allocation granularity of the device."""
    cu = _cu()
    gran = int(_check(cu.cuMemGetAllocationGranularity(
        _prop(device_index), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    return (max(size, 1) + gran - 1) // gran * gran


class CudaArena:
    """A writable VMM region on one GPU for the daemon to fill, exportable as a POSIX fd."""

    transport = "cuda"

    def __init__(self, size: int, device_index: int) -> None:
        cu = _cu()
        use_primary_context(device_index)
        self.device_index = device_index
        self.size = round_up(size, device_index)
        handle = _check(cu.cuMemCreate(self.size, _prop(device_index), 0))
        self._mapping = _Mapping(handle, self.size, device_index, read_only=False)
        self.region: torch.Tensor | None = self._mapping.as_tensor()
        self._fd = int(_check(cu.cuMemExportToShareableHandle(
            handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))

    def export_fd(self) -> int:
        """The fd to pass to clients (stays owned by this object)."""
        return self._fd

    def finish(self) -> None:
        """Wait until every copy into the region has landed; the region is ready to share."""
        torch.cuda.synchronize(self.device_index)
        self.region = None

    def close(self) -> None:
        """Release the daemon's fd and mapping (clients' mappings stay valid)."""
        import os

        self.region = None
        os.close(self._fd)
        self._mapping.close()


def map_readonly(fd: int, size: int, device_index: int) -> tuple[torch.Tensor, _Mapping]:
    """Import an arena fd on `device_index`, mapped read-only: (uint8 tensor, mapping to keep)."""
    use_primary_context(device_index)
    return import_readonly(fd, size, device_index)


def map_readwrite(fd: int, size: int, device_index: int) -> tuple[torch.Tensor, _Mapping]:
    """Import a KV pool fd on `device_index`, mapped read-write: (uint8 tensor, mapping to keep)."""
    use_primary_context(device_index)
    return _import(fd, size, device_index, read_only=False)


def import_readonly(fd: int, size: int, device_index: int) -> tuple[torch.Tensor, _Mapping]:
    """`map_readonly` without making the context current (it must already be, on this thread)."""
    return _import(fd, size, device_index, read_only=True)


def _import(fd: int, size: int, device_index: int, read_only: bool) -> tuple[torch.Tensor, _Mapping]:
    cu = _cu()
    handle = _check(cu.cuMemImportFromShareableHandle(
        fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    mapping = _Mapping(handle, size, device_index, read_only=read_only)
    return mapping.as_tensor(), mapping
