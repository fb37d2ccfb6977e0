"""Page-locking host memory that already exists: the arena (allgather) or the mmap'd checkpoint (local).

CUDA-only at run time, but pure bookkeeping around one `cudart` object, so the CPU tests drive it with a
stand-in that records the calls (tests/unit/test_pinning.py).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

CUDA_HOST_REGISTER_DEFAULT = 0
# cudaHostRegisterReadOnly: the device only reads the range. Required to register memory that is mapped
# read-only (our checkpoint maps); the driver refuses the flag where the device does not support it
# (cudaDevAttrHostRegisterReadOnlySupported), and we fall back to staging copies.
CUDA_HOST_REGISTER_READ_ONLY = 0x08
PAGE = mmap.PAGESIZE


CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


class Runtime:
    """What registration needs from the CUDA runtime: torch's cudaHostRegister / cudaHostUnregister, and,
    from the libcudart torch has loaded (ctypes), cudaGetLastError and cudaDeviceGetAttribute, which torch
    does not bind. A failed cudaHostRegister leaves its error as the thread's last error, and torch's
    check after the next kernel launch would raise it there, far from the cause: it must be cleared."""

    def __init__(self) -> None:
        self._torch = torch.cuda.cudart()
        self._lib = _libcudart()

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._torch.cudaHostRegister(ptr, nbytes, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._torch.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:
        return int(self._lib.cudaGetLastError()) if self._lib is not None else 0

    def read_only_supported(self, device: int) -> bool:
        """Whether cudaHostRegisterReadOnly may be tried. Without libcudart we could not clear a refusal's
        error: then never try (local mode stages instead)."""
        if self._lib is None:
            return False
        value = ctypes.c_int(0)
        attr = CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED
        if self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device) != 0:
            self._lib.cudaGetLastError()
            return False
        return value.value == 1


def _libcudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):  # the one torch loaded is found first
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def clear_error(cudart) -> None:
    """Take the error a failed runtime call left behind (stand-ins in tests may have no such call)."""
    clear = getattr(cudart, "cudaGetLastError", None)
    if clear is not None:
        clear()


class PinnedRegion:
    """cudaHostRegister exactly [ptr, ptr + nbytes): unlike torch's pinned allocator, which rounds every
    block up to a power of two (a 40 GB arena would cost up to 64 GB pinned)."""

    def __init__(self, ptr: int, nbytes: int, flags: int = CUDA_HOST_REGISTER_DEFAULT, cudart=None):
        self._cudart = cudart if cudart is not None else Runtime()
        self.ptr, self.nbytes, self.flags = ptr, nbytes, flags
        code = int(self._cudart.cudaHostRegister(ptr, nbytes, flags))
        if code != 0:
            self.ptr = None
            clear_error(self._cudart)  # else the next kernel launch reports it, far from here
            raise RegistrationError(code, nbytes)

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, cudart=None) -> PinnedRegion:
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size(), cudart=cudart)

    def close(self) -> None:
        if self.ptr is not None:
            self._cudart.cudaHostUnregister(self.ptr)
            self.ptr = None


class RegistrationError(RuntimeError):
    def __init__(self, code: int, nbytes: int):
        self.code = code
        super().__init__(
            f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (CUDA error {code}): the locked-memory "
            "limit (`ulimit -l`, container memlock) or host RAM is too small; use more ranks or nodes "
            "(smaller shards each) or --offload local"
        )


def page_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """[start, stop) of whole pages covering [ptr, ptr + nbytes): what cudaHostRegister accepts."""
    start = ptr // PAGE * PAGE
    stop = -(-(ptr + nbytes) // PAGE) * PAGE
    return start, stop - start


def group_span(tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """One page span (start, length) covering every tensor of a group (views into one mapped file), or
    None for an empty group. Never merged across groups: two maps may be adjacent in the address space
    but are separate mappings."""
    spans = [page_span(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    if not spans:
        return None
    start = min(s for s, _ in spans)
    return start, max(s + n for s, n in spans) - start


def register_read_only(
    groups: list[list[torch.Tensor]], cudart=None, device: int = 0
) -> list[PinnedRegion] | None:
    """Register, read-only, the pages under each group of tensors (each group: views of one read-only
    map), or return None if the device does not support it or the driver refuses any of it (then nothing
    stays registered, and no error is left pending). A span never runs past its map: a view's last byte
    lies in the map's last page, and mappings are whole pages."""
    cudart = cudart if cudart is not None else Runtime()
    supported = getattr(cudart, "read_only_supported", None)
    if supported is not None and not supported(device):
        return None
    regions: list[PinnedRegion] = []
    try:
        for span in filter(None, map(group_span, groups)):
            regions.append(PinnedRegion(span[0], span[1], CUDA_HOST_REGISTER_READ_ONLY, cudart))
    except RegistrationError:
        for region in regions:
            region.close()
        return None
    return regions
