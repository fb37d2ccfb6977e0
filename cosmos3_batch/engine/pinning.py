"""Page-locking host memory that already exists: the arena (allgather) or the mmap'd checkpoint (local).

CUDA-only at run time, but pure bookkeeping around one `cudart` object, so the CPU tests drive it with a
stand-in that records the calls (tests/unit/test_pinning.py).
"""

from __future__ import annotations

import mmap

import torch

CUDA_HOST_REGISTER_DEFAULT = 0
# cudaHostRegisterReadOnly: the device only reads the range. Required to register memory that is mapped
# read-only (our checkpoint maps); the driver refuses the flag where the device does not support it
# (cudaDevAttrHostRegisterReadOnlySupported), and we fall back to staging copies.
CUDA_HOST_REGISTER_READ_ONLY = 0x08
PAGE = mmap.PAGESIZE


class PinnedRegion:
    """cudaHostRegister exactly [ptr, ptr + nbytes): unlike torch's pinned allocator, which rounds every
    block up to a power of two (a 40 GB arena would cost up to 64 GB pinned)."""

    def __init__(self, ptr: int, nbytes: int, flags: int = CUDA_HOST_REGISTER_DEFAULT, cudart=None):
        self._cudart = cudart if cudart is not None else torch.cuda.cudart()
        self.ptr, self.nbytes, self.flags = ptr, nbytes, flags
        code = int(self._cudart.cudaHostRegister(ptr, nbytes, flags))
        if code != 0:
            self.ptr = None
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


def register_read_only(groups: list[list[torch.Tensor]], cudart=None) -> list[PinnedRegion] | None:
    """Register, read-only, the pages under each group of tensors (each group: views of one read-only
    map), or return None if the driver refuses any of it (then nothing stays registered). A span never
    runs past its map: a view's last byte lies in the map's last page, and mappings are whole pages."""
    regions: list[PinnedRegion] = []
    try:
        for span in filter(None, map(group_span, groups)):
            regions.append(PinnedRegion(span[0], span[1], CUDA_HOST_REGISTER_READ_ONLY, cudart))
    except RegistrationError:
        for region in regions:
            region.close()
        return None
    return regions
