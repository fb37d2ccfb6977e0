"""The transport of a group decode or encode (`--vae-patch-parallel-size P`, DESIGN.md §15): the halo
exchange model/vae_patch.py asks for, over a process group.

A `PatchGroup` is P ranks of one process group (its group ranks 0..P-1; the group may hold more: the encode
runs on the `--sp` group, whose every rank needs the encoded latent). A walk binds it to the cut it uses
(`bind(shard)`); ranks past the used shards take part only in the whole-group calls (`broadcast`,
`share_int`), so a decode that is too small to split costs its idle ranks nothing.

Point-to-point only between used shards, and never both directions of a pair at once (NCCL would
deadlock there without a group call): the halo moves downwards, then upwards; the whole-frame attention
is gathered to the first shard, computed there once (the reference's call), and its rows sent back;
the decoded frames go to the first shard's rank, the writer. Every used shard issues these in the same
order because they walk the same modules; a decode runs on the finisher thread with a process group of
its own, the encode on the pass loop's thread with the `--sp` group's, so neither interleaves with the
other's messages.

On a GPU the decode team's group is gloo, its messages staged through host memory (`host_staged`): the
finisher thread issues them while the pass loop's thread issues the layer gathers and `--sp` all-to-alls on
NCCL, at moments that differ per rank, and NCCL documents that communicators used concurrently from threads
whose order differs across ranks can deadlock (their kernels block the device waiting for peers). gloo
messages are host calls: they hold no device resource and no stream, so no order between the two threads
matters. The decode's copies to and from host memory wait on the finisher's own stream only. The encode
team stays on the `--sp` group's NCCL communicator: the pass loop's thread issues it in its one order, as it
does the gathers. `warm_up` makes every connection a decode will use before the pass loop starts.

A call of the process group that fails (posting or waiting) raises `PeerLost`: gloo and NCCL raise a plain
RuntimeError for a closed connection or a timeout, and the team must tell that from its own compute's
failure to say which one ended the job. The encode's whole-group broadcasts are noted in the pass trace
(`note`, set by the pass loop): every rank of the `--sp` group issues them, in the pass loop's order. Every
wait for a message is marked for rank 0's live warning (`mark`): a peer named by its rank in the group,
which on rank 0 is its global rank (rank 0's groups are ranks 0..S-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from cosmos3_batch.model.vae_patch import Shard
from cosmos3_batch.parallel.sequence import group_ranks
from cosmos3_batch.parallel.stall import phase
from cosmos3_batch.parallel.waiting import WaitMark, peers


class GroupBroken(RuntimeError):
    """The group's decodes or encodes can no longer be kept in step: the job must end
    (pipeline/finish/vae_team.py says when). Its message says what failed, on this rank."""


class PeerLost(RuntimeError):
    """A message of the group could not be sent or received: a peer rank died or stalled."""


def _checked(call: Callable):
    try:
        return call()
    except RuntimeError as exc:
        raise PeerLost(f"{type(exc).__name__}: {exc}") from exc


class _Work:
    """A posted message: its `wait` raises PeerLost if it fails, and is marked as a wait for `who`."""

    def __init__(self, work, group: PatchGroup, who: str | None, staged=None):
        self.work, self.group, self.who = work, group, who
        self.staged = staged  # (host buffer, its device tensor): filled from the host once received

    def wait(self) -> None:
        mark = self.group.mark
        if mark is None:
            _checked(self.work.wait)
        else:
            with mark.waiting(self.group.what, self.who):
                _checked(self.work.wait)
        if self.staged is not None:
            host, device = self.staged
            device.copy_(host)


@dataclass
class PatchGroup:
    pg: object  # a ProcessGroup (from new_group, or one built directly in tests)
    index: int  # this rank's rank in pg
    parts: int  # P: the first P ranks of pg decode (or encode) together
    size: int  # ranks in pg (>= P)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    messages: int = 0  # point-to-point tensors sent by this rank (exact: the tests count them)
    sent_bytes: int = 0
    note: Callable[[str], None] | None = None  # the pass trace (the encode group's only: see the module doc)
    # The waiting thread's mark for rank 0's live warning (parallel/waiting.py; the pass loop's for encodes,
    # the finisher's for decodes) and how the warning names these messages.
    mark: WaitMark | None = None
    what: str = "a VAE group exchange (decode)"
    host_staged: bool = False  # a gloo group for device tensors: messages go through host memory

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", copy=True) if self.host_staged else tensor

    @property
    def member(self) -> bool:
        return self.index < self.parts

    def bind(self, cut: Shard) -> _Bound:
        """The exchange of this rank's shard of the cut (`exchange.shard`; this rank must be one of the used
        shards, whatever the cut's own index)."""
        assert self.index < len(cut.sizes)
        return _Bound(self, replace(cut, index=self.index))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """`tensor` from pg rank `root` on every rank of pg, in place."""
        if self.note is not None:
            self.note(f"broadcast:{'x'.join(map(str, tensor.shape))}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        host = self._host(tensor)
        staged = (host, tensor) if host is not tensor else None
        _Work(_checked(lambda: self.pg.broadcast([host], opts)), self, peers(self.size), staged).wait()
        return tensor

    def warm_up(self) -> None:
        """One broadcast, then one message each way between neighbours (as a halo moves: down, then up),
        before the pass loop: every connection a decode uses is made at start, none mid-run. Counts
        nothing (the message counters are the decodes')."""
        self.share_int(0)
        probe = torch.zeros(1, device=self.device)
        for low in range(self.parts - 1):
            for src, dst in ((low, low + 1), (low + 1, low)):
                if self.index == src:
                    _Work(_checked(lambda d=dst: self.pg.send([self._host(probe)], d, 0)), self, None).wait()
                elif self.index == dst:
                    box = [self._host(probe.clone())]
                    _Work(_checked(lambda s=src, b=box: self.pg.recv(b, s, 0)), self, None).wait()

    def share_int(self, value: int, root: int = 0) -> int:
        """`value` of pg rank `root`, on every rank of pg."""
        shared = self.broadcast(torch.tensor([value], dtype=torch.int64, device=self.device), root)
        if self.mark is None:  # NCCL: the broadcast returned once queued; the read waits for it
            return int(_checked(shared.item))
        with self.mark.waiting(self.what, peers(self.size)):
            return int(_checked(shared.item))

    def _send(self, tensor: torch.Tensor, to: int):
        tensor = tensor.contiguous()
        self.messages += 1
        self.sent_bytes += tensor.numel() * tensor.element_size()
        # The tensor is kept alive until the send is waited on (staged: its host copy).
        tensor = self._host(tensor)
        return _Work(_checked(lambda: self.pg.send([tensor], to, 0)), self, f"rank {to}"), tensor

    def _recv(self, like: torch.Tensor, rows: int, dim: int, source: int):
        shape = list(like.shape)
        shape[dim] = rows
        buffer = like.new_empty(shape)
        host = self._host(buffer)
        staged = (host, buffer) if host is not buffer else None
        work = _Work(_checked(lambda: self.pg.recv([host], source, 0)), self, f"rank {source}", staged)
        return work, buffer


class _Bound:
    """`Exchange` (model/vae_patch.py) for one walk of one shard."""

    def __init__(self, group: PatchGroup, shard: Shard):
        self.group, self.shard = group, shard
        self.used = len(shard.sizes)

    def halo(self, x, dim, before, after):
        k = self.shard.index
        top = self._step(x, dim, before, to=k + 1, source=k - 1, send_last=True)
        bottom = self._step(x, dim, after, to=k - 1, source=k + 1, send_last=False)
        return top, bottom

    def _step(self, x, dim, rows: int, to: int, source: int, send_last: bool):
        """One direction: my edge rows to `to`, the same count from `source` (out-of-range: nobody)."""
        if not rows:
            return None
        g, works, got = self.group, [], None
        if 0 <= to < self.used:
            edge = x.narrow(dim, x.shape[dim] - rows if send_last else 0, rows)
            works.append(g._send(edge, to))
        if 0 <= source < self.used:
            work, got = g._recv(x, rows, dim, source)
            works.append((work, got))
        for work, _ in works:
            work.wait()
        return got

    def on_whole(self, x, dim, fn: Callable[[torch.Tensor], torch.Tensor]):
        if self.used == 1:
            return fn(x)
        g, shard = self.group, self.shard
        scale = x.shape[dim] // shard.rows
        if shard.index:
            g._send(x, 0)[0].wait()
            work, mine = g._recv(x, shard.rows * scale, dim, 0)
            work.wait()
            return mine
        whole = fn(torch.cat([x, *self._gather(x, dim, scale)], dim))
        start = shard.rows * scale
        sends = []
        for k in range(1, self.used):
            rows = shard.sizes[k] * scale
            sends.append(g._send(whole.narrow(dim, start, rows), k))
            start += rows
        for work, _ in sends:
            work.wait()
        return whole.narrow(dim, 0, shard.rows * scale).contiguous()

    def collect(self, x, dim):
        if self.used == 1:
            return x
        if self.shard.index:
            self.group._send(x, 0)[0].wait()
            return None
        scale = x.shape[dim] // self.shard.rows
        return torch.cat([x, *self._gather(x, dim, scale)], dim)

    def _gather(self, x, dim, scale) -> list[torch.Tensor]:
        """On the first shard: every other shard's x, in order."""
        works = [self.group._recv(x, self.shard.sizes[k] * scale, dim, k) for k in range(1, self.used)]
        for work, _ in works:
            work.wait()
        return [buffer for _, buffer in works]


def build_decode_group(
    rank: int, world_size: int, sp: int, parts: int, device: torch.device, timeout_s: float
) -> PatchGroup | None:
    """The decode team of this rank's --sp group: its first P ranks, on a process group of their own (the
    finisher thread's). Every rank creates every team's group, in the same order (torch requires it of
    `new_group`); None on the group's other ranks and at P = 1."""
    if parts == 1:
        return None
    mine = None
    for ranks in group_ranks(world_size, sp):
        team = ranks[:parts]
        # gloo on every device (the module doc says why): on a GPU its messages are staged through the host.
        group = dist.new_group(team, backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in team:
            mine = PatchGroup(
                group, team.index(rank), parts, parts, device, host_staged=device.type == "cuda"
            )
    return mine


def encode_group(seq_pg, sp_rank: int, sp: int, parts: int, device: torch.device) -> PatchGroup | None:
    """The encode team: the first P ranks of the --sp group, on the group's own process group (the pass
    loop's thread issues both its all-to-alls and the encodes of the requests it admits)."""
    if parts == 1:
        return None
    return PatchGroup(seq_pg, sp_rank, parts, sp, device, what=phase("broadcast"))
