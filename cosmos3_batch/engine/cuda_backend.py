"""The CUDA-only part of the transport: streams, events and pinned host memory. Kept this small on
purpose: layout, ordering and bookkeeping are shared with the CPU backend and tested there; the
ordering below is tested on CPU with stand-in streams/events (tests/unit/test_cuda_ordering.py).

Per fetch of part k into slot s:
    copy stream:  wait slot_free[s] -> H2D own shard (pinned, non_blocking) -> record copied[s]
    comm stream:  wait copied[s]    -> AllGather in place (NCCL)              -> record ready[s]
    compute:      wait ready[s] (in `wait`), run the part, record slot_free[s] (in `release`)
No host blocking and no device-wide synchronize in the steady state: only stream-event edges.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from cosmos3_batch.engine.transport import Counters, FetchSource, OffloadMode, copy_in, gather


class PinnedRegion:
    """cudaHostRegister one existing host tensor: exactly its bytes, unlike torch's pinned allocator,
    which rounds every block up to a power of two (a 40 GB arena would cost up to 64 GB pinned)."""

    def __init__(self, tensor: torch.Tensor, cudart=None):
        self.tensor = tensor
        self._cudart = cudart if cudart is not None else torch.cuda.cudart()
        nbytes = tensor.numel() * tensor.element_size()
        code = self._cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(code) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (CUDA error {int(code)}): the "
                "locked-memory limit (`ulimit -l`, container memlock) or host RAM is too small; use more "
                "ranks or nodes (smaller shards each) or --offload local"
            )

    def close(self) -> None:
        if self.tensor is not None:
            self._cudart.cudaHostUnregister(self.tensor.data_ptr())
            self.tensor = None


class CudaBackend:
    def __init__(self, source: FetchSource, slots: list[torch.Tensor], counters: Counters, device, cuda=None):
        self.cuda = cuda if cuda is not None else torch.cuda  # stand-ins in the CPU ordering test
        self.source = source
        self.slots = slots
        self.counters = counters
        self.compute = self.cuda.current_stream(device)
        self.copy_stream = self.cuda.Stream(device)
        self.comm_stream = self.cuda.Stream(device)
        self.slot_free = [self.cuda.Event() for _ in slots]
        self.copied = [self.cuda.Event() for _ in slots]
        self.ready = [self.cuda.Event() for _ in slots]
        self._pinned: list[PinnedRegion] = []
        self._staging: list[torch.Tensor] = []
        self._staged = [self.cuda.Event() for _ in slots]
        self._worker = None
        if source.mode is OffloadMode.ALLGATHER and cuda is None:
            self._pinned.append(PinnedRegion(source.host.arena))
        if source.mode is OffloadMode.LOCAL:
            # mmap'd pages cannot be DMA'd from directly: a host thread copies each part into one of two
            # pinned staging buffers, then the copy stream moves it to the slot.
            size = slots[0].numel()
            self._staging = [torch.empty(size, dtype=torch.uint8) for _ in slots]
            if cuda is None:
                self._pinned += [PinnedRegion(buf) for buf in self._staging]
            # The thread must drive this rank's GPU: a new thread starts on device 0, where it would create
            # a context (and memory) on another rank's GPU.
            init = (lambda: None) if cuda is not None else (lambda: torch.cuda.set_device(device))
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-stage", initializer=init)

    def release(self, slot: int) -> None:
        # Everything that reads this slot has been issued on the compute stream by now.
        self.slot_free[slot].record(self.compute)

    def submit(self, index: int, slot: int):
        if self.source.mode is OffloadMode.LOCAL:
            return self._worker.submit(self._stage_and_copy, index, slot)
        with self.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.slot_free[slot])  # the part two steps back is done reading
            copy_in(self.source, index, self.slots[slot], self.counters, non_blocking=True)
            self.copied[slot].record(self.copy_stream)
        with self.cuda.stream(self.comm_stream):
            self.comm_stream.wait_event(self.copied[slot])  # gather only what has fully landed
            gather(self.source, index, self.slots[slot], self.counters)
            self.ready[slot].record(self.comm_stream)
        self.counters.fetches += 1
        return None

    def _stage_and_copy(self, index: int, slot: int) -> None:
        layout = self.source.layouts[index]
        staging = self._staging[slot]
        # The previous H2D out of this staging buffer must be done before the host overwrites it: an
        # event wait on the host (one stream's progress), never a device-wide synchronize.
        self._staged[slot].synchronize()
        for data, offset in self.source.local[index]:
            staging[offset : offset + data.numel()].copy_(data)
        with self.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.slot_free[slot])
            self.slots[slot][: layout.nbytes].copy_(staging[: layout.nbytes], non_blocking=True)
            self._staged[slot].record(self.copy_stream)
            self.ready[slot].record(self.copy_stream)
        self.counters.h2d_bytes += layout.payload_bytes
        self.counters.fetches += 1

    def wait(self, handle, slot: int) -> None:
        if handle is not None:
            handle.result()  # the staging thread has issued its copy (local mode)
        self.compute.wait_event(self.ready[slot])  # device-side edge: the host does not block

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self._pinned:
            # Teardown only (not the steady state): DMA out of the arena may still be in flight after an
            # error mid-pass; unregistering under it would be undefined.
            self.copy_stream.synchronize()
            self.comm_stream.synchronize()
        for region in self._pinned:
            region.close()
