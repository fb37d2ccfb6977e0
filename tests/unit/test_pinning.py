"""Registration of existing host memory (pinning.py) and `local` mode's two CUDA paths, on CPU.

A stand-in `cudart` records cudaHostRegister calls and answers with a chosen error code; the stand-in
streams come from test_cuda_ordering. Exact: which byte ranges are registered with which flags, and the
bytes a staged fetch puts in the slot.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.engine import cuda_backend
from cosmos3_batch.engine.offload import LayerOffload, OffloadConfig, PartBinding
from cosmos3_batch.engine.pinning import (
    CUDA_HOST_REGISTER_READ_ONLY,
    PAGE,
    PinnedRegion,
    RegistrationError,
    group_span,
    page_span,
    register_read_only,
)
from cosmos3_batch.engine.transport import OffloadMode
from tests.unit.test_cuda_ordering import FakeCuda


class FakeCudart:
    """Answers like the runtime: a refused call leaves its error as the thread's last error until
    cudaGetLastError takes it (else torch's check after the next kernel launch would raise it)."""

    def __init__(self, refuse_flags: int | None = None, read_only: bool = True):
        self.registered: dict[int, tuple[int, int]] = {}
        self.calls: list[tuple[int, int, int]] = []
        self.refuse_flags = refuse_flags
        self.read_only = read_only
        self.pending = 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        if flags == self.refuse_flags:
            self.pending = 801
            return 801  # cudaErrorNotSupported
        self.registered[ptr] = (nbytes, flags)
        return 0

    def cudaGetLastError(self):
        error, self.pending = self.pending, 0
        return error

    def read_only_supported(self, device):
        return self.read_only

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


def test_page_spans_cover_whole_pages():
    assert page_span(PAGE * 3 + 5, 10) == (PAGE * 3, PAGE)
    assert page_span(PAGE * 3, PAGE) == (PAGE * 3, PAGE)
    assert page_span(PAGE * 3 - 1, 2) == (PAGE * 2, 2 * PAGE)
    base = torch.empty(10 * PAGE, dtype=torch.uint8)
    start = -(-base.data_ptr() // PAGE) * PAGE - base.data_ptr()  # first page boundary inside `base`
    views = [base[start + 10 : start + 20], base[start + 3 * PAGE + 1 : start + 3 * PAGE + 2]]
    assert group_span(views) == (base.data_ptr() + start, 4 * PAGE)
    assert group_span([base[:0]]) is None


def test_a_refused_registration_leaves_nothing_registered():
    cudart = FakeCudart(refuse_flags=CUDA_HOST_REGISTER_READ_ONLY)
    a, b = torch.empty(3 * PAGE, dtype=torch.uint8), torch.empty(3 * PAGE, dtype=torch.uint8)
    assert register_read_only([[a], [b]], cudart) is None
    assert cudart.registered == {} and cudart.pending == 0  # refused, and no error left for the next launch
    unsupported = FakeCudart(read_only=False)  # cudaDevAttrHostRegisterReadOnlySupported = 0: not even tried
    assert register_read_only([[a], [b]], unsupported) is None and unsupported.calls == []
    ok = FakeCudart()
    regions = register_read_only([[a], [b]], ok)
    assert [flags for _, _, flags in ok.calls] == [CUDA_HOST_REGISTER_READ_ONLY] * 2
    assert all(ptr % PAGE == 0 and nbytes % PAGE == 0 for ptr, nbytes, _ in ok.calls)
    for region in regions:
        region.close()
    assert ok.registered == {}


def test_pinned_region_registers_exactly_the_tensor():
    cudart = FakeCudart()
    arena = torch.empty(3 * 2**20 + 17, dtype=torch.uint8)
    region = PinnedRegion.of_tensor(arena, cudart)
    assert cudart.calls == [(arena.data_ptr(), arena.numel(), 0)]
    region.close()
    assert cudart.registered == {}
    refusing = FakeCudart(refuse_flags=0)
    try:
        PinnedRegion.of_tensor(arena, refusing)
    except RegistrationError as exc:
        assert exc.code == 801 and "ulimit -l" in str(exc) and refusing.pending == 0
    else:
        raise AssertionError("a refused registration must raise")


def local_engine(tmp_path, monkeypatch, cudart):
    """Local-mode LayerOffload over two 2-part files (one 1 MiB tensor per part), CudaBackend on stand-ins."""
    with torch.device("meta"):
        parts = [nn.Linear(512, 512, bias=False) for _ in range(4)]
    tensors = {f"p{i}.weight": torch.randn(512, 512) for i in range(4)}
    save_file({k: tensors[k] for k in ("p0.weight", "p1.weight")}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in ("p2.weight", "p3.weight")}, str(tmp_path / "b.safetensors"))
    bindings = [PartBinding(f"p{i}", ((m, "weight", f"p{i}.weight"),)) for i, m in enumerate(parts)]
    engine = LayerOffload(
        bindings, TensorStore(tmp_path), OffloadConfig(OffloadMode.LOCAL), torch.device("cpu")
    )
    engine.backend.close(1.0)
    fake = FakeCuda()
    engine.backend = cuda_backend.CudaBackend(engine.source, engine.slots, "cpu", cuda=fake, cudart=cudart)
    fake.backend = engine.backend
    return engine, fake, parts, tensors


def test_local_mode_registers_the_mapped_files_read_only(tmp_path, monkeypatch):
    cudart = FakeCudart()
    engine, fake, parts, tensors = local_engine(tmp_path, monkeypatch, cudart)
    assert engine.backend.registered and engine.backend._worker is None
    # One read-only, page-aligned registration per file, covering every layer byte of that file.
    assert len(cudart.calls) == 2 and {flags for _, _, flags in cudart.calls} == {
        CUDA_HOST_REGISTER_READ_ONLY
    }
    spans = [(ptr, ptr + nbytes) for ptr, nbytes, _ in cudart.calls]
    for pieces in engine.source.local:
        for piece in pieces:
            ptr, size = piece.data.data_ptr(), piece.data.numel()
            assert any(lo <= ptr and ptr + size <= hi for lo, hi in spans)
    engine.begin_pass([0, 1, 2, 3])
    for i in range(4):
        engine.acquire(i)
        assert torch.equal(parts[i].weight, tensors[f"p{i}.weight"])  # DMA'd (here: copied) from the map
    engine.end_pass()
    # The copy goes straight from the map on the copy stream; no staging thread, no host wait.
    assert not [e for e in fake.log if e[0] == "host_wait"]
    engine.close()
    assert cudart.registered == {}


def test_local_mode_stages_with_threads_when_registration_is_refused(tmp_path, monkeypatch):
    cudart = FakeCudart(refuse_flags=CUDA_HOST_REGISTER_READ_ONLY)
    monkeypatch.setattr(cuda_backend, "STAGING_CHUNK", 100_000)  # 11 chunks per 1 MiB part: several threads
    assert len(cuda_backend._chunks(2**20)) == 11 and cuda_backend._chunks(2**20)[-1] == (1_000_000, 2**20)
    engine, _, parts, tensors = local_engine(tmp_path, monkeypatch, cudart)
    backend = engine.backend
    assert not backend.registered
    # Only the staging buffers are pinned: exactly their bytes, default flags.
    assert sorted(cudart.registered.values()) == sorted((buf.numel(), 0) for buf in backend._staging)
    for _ in range(2):
        engine.begin_pass([0, 1, 2, 3])
        for i in range(4):
            engine.acquire(i)
            assert torch.equal(parts[i].weight, tensors[f"p{i}.weight"])
        engine.end_pass()
    engine.close()
    assert cudart.registered == {}
