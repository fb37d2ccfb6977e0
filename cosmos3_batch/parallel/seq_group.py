"""The process group of one `--sp` group and its all-to-all (the transport model/ulysses.py calls).

Every rank creates every group's communicator, in the same order (torch requires it of `new_group`),
then keeps its own. The all-to-alls run on the compute thread and (CUDA) the compute stream, on a group of
their own: they never interleave with the layer gathers on the gather group, which the CPU fetch worker
issues from its own thread, and CUDA issues from the compute thread onto the comm stream (so on CUDA every
rank issues gathers and all-to-alls in the same host order, and the two communicators cannot wait on
each other). Each one is noted in the pass trace with its row counts, so a test
can hold every rank of a group to the same sequence of collectives. Each is also a wait marked for rank 0's
live warning (`mark`, the pass loop's: parallel/waiting.py): a stalled partner holds the group there.

Agreements (a few flags, read on the host at once) run on a gloo group of the same ranks (`host`; on CPU the
group itself): on a device group they would block the host until the compute stream drains, a device sync
DESIGN.md §5 forbids in the steady state (PassSync's exchange is on gloo for the same reason).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import collective_call
from cosmos3_batch.parallel.sequence import group_ranks
from cosmos3_batch.parallel.stall import phase
from cosmos3_batch.parallel.waiting import WaitMark, peers
from cosmos3_batch.parallel.world import CPU

_LABELS = {
    event: phase(event) for event in ("all_to_all", "max", "agree", "share")
}  # "an --sp all-to-all", ...


@dataclass
class SeqGroup:
    size: int  # S
    rank: int  # this rank's index in its group (0 leads: decodes, writes, reports)
    index: int  # which group (the "rank" of the pass protocol)
    group: object = None
    device: torch.device = CPU  # where the group's tensors live (NCCL: this rank's GPU)
    note: Callable[[str], None] | None = None  # the pass trace (PassSync.note)
    host: object = None  # a gloo group of the same ranks, for `agree` (the group itself on CPU)
    all_to_alls: int = 0
    mark: WaitMark | None = None  # the pass loop's wait mark (PassSync.waiting), set with `note`

    def _waiting(self, event: str):
        """Mark a wait on the group's ranks (its first rank's partners are ranks 1..S-1 of the world)."""
        if self.mark is None:
            return contextlib.nullcontext()
        return self.mark.waiting(_LABELS[event], peers(self.size))

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_to_all_rows(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        self.all_to_alls += 1
        if self.note is not None:
            # Named the same on every rank of the group: the group's row split (one side is this rank's own
            # rows repeated) and the shape of a row.
            split = recv_rows if len(set(send_rows)) == 1 else send_rows
            row = "x".join(map(str, send.shape[1:]))
            self.note(f"all_to_all:{','.join(map(str, split))}:{row}")
        out = send.new_empty((sum(recv_rows), *send.shape[1:]))
        with self._waiting("all_to_all"), collective_call(_LABELS["all_to_all"]):
            dist.all_to_all_single(out, send, recv_rows, send_rows, group=self.group)
        return out

    def max_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """Elementwise max over the group (W8A8's per-sequence activation amaxes under --sp, model/fp8.py):
        one all-reduce however many sequences."""
        if self.note is not None:
            self.note(f"max:{value.numel()}")
        out = value.reshape(-1).to(self.device, torch.float32)
        with self._waiting("max"), collective_call(_LABELS["max"]):
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out.reshape(value.shape)

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag AND-ed over the group's ranks (one small all-reduce, on `host`: no device sync)."""
        if self.note is not None:
            self.note(f"agree:{len(flags)}")
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        with self._waiting("agree"), collective_call(_LABELS["agree"]):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.host)
        return [bool(v) for v in tensor.tolist()]

    def share_lead(self, values: list[float]) -> list[float]:
        """The group lead's values on every member (a small broadcast on `host`). What each member decides
        from them is then the same on all: a float that differs by one bit between members (another kernel,
        another reduction order on a GPU) cannot make one member run layers, and their all-to-alls, that
        another skips."""
        if self.note is not None:
            self.note("share")
        box = [list(values)]
        with self._waiting("share"), collective_call(_LABELS["share"]):
            dist.broadcast_object_list(box, group_src=0, group=self.host)
        return box[0]


def build_seq_group(
    rank: int, world_size: int, sp: int, device: torch.device, timeout_s: float
) -> SeqGroup | None:
    """This rank's group, or None at --sp 1 (no group, no extra collective)."""
    if sp == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    mine = host = None
    for ranks in group_ranks(world_size, sp):
        # Collective over the whole world: every rank makes every group, in the same order.
        with collective_call("creating the --sp groups"):  # a dead peer: the store's meeting fails
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            on_host = group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            mine, host = group, on_host
    return SeqGroup(sp, rank % sp, rank // sp, mine, device, host=host)
