"""Ulysses attention for one branch whose GEN rows are split over a sequence-parallel group (`--sp`).

Each rank of the group holds rows [start, start + rows[rank]) of the GEN stream and runs the token-wise
ops (norms, projections, rotary, MLP) on them alone. Attention needs the whole sequence, so around it:

1. one all-to-all sends every rank the q|k|v rows of its H/S heads from every rank: each rank then holds
   the full sequence for its heads (rows arrive in rank order, which is sequence order);
2. it attends over the (replicated) UND K/V of its KV heads + the full GEN K/V, exactly the call the
   unsplit path makes, restricted to its heads (per-head attention does not depend on the other heads);
3. one all-to-all sends every rank back its rows, for all heads, in head order.

The rows and heads are the only things that move; every value is computed from the same inputs by the
same op as in the reference, so on CPU float32 the output stays bit-identical (parallel/sequence.py says
what that needs of the shard sizes). The transport is the caller's (`GroupComm`): nothing here knows
about processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cosmos3_batch.model.heads import HeadSplit


class GroupComm(Protocol):
    """The group's all-to-all over dim 0 with uneven row counts (what `all_to_all_single` does)."""

    size: int
    rank: int

    def all_to_all_rows(
        self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]
    ) -> torch.Tensor: ...


@dataclass
class SeqShard:
    """Which GEN rows of a branch this rank holds, and the group that holds the rest."""

    comm: GroupComm
    rows: list[int]  # per group rank, in rank order (sequence_parallel.shard_rows)
    heads: HeadSplit

    @property
    def start(self) -> int:
        return sum(self.rows[: self.comm.rank])

    @property
    def local(self) -> slice:
        return slice(self.start, self.start + self.rows[self.comm.rank])

    @property
    def kv_heads(self) -> slice:
        """The KV heads this rank's query heads read."""
        split, rank = self.heads, self.comm.rank
        first = rank // split.repeat if split.repeat > 1 else rank * split.kv
        return slice(first, first + split.kv)

    def own_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of a layer's UND K/V [U, KV, D] this rank's attention reads: the cache keeps only that
        (the UND half runs whole on every rank of the group, but each attends for its own heads)."""
        return k[:, self.kv_heads].clone(), v[:, self.kv_heads].clone()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full stream from every rank's rows (an all-gather with uneven rows, as one all-to-all)."""
        size = self.comm.size
        mine = self.rows[self.comm.rank]
        send = local.unsqueeze(0).expand(size, *local.shape).reshape(size * mine, *local.shape[1:])
        return self.comm.all_to_all_rows(send.contiguous(), [mine] * size, self.rows)

    def attend(self, attend_fn, q, k, v, k_und: torch.Tensor, v_und: torch.Tensor) -> torch.Tensor:
        """attend_fn(q, k, v) over this rank's heads; q [rows, H, D], k/v [rows, KV, D] local GEN rows,
        k_und/v_und [U, KV/S, D] the branch's cached UND keys/values of this rank's KV heads (`own_kv`).
        Returns [rows, H * D] like attend_fn."""
        size, rank, split = self.comm.size, self.comm.rank, self.heads
        mine = self.rows[rank]
        d = q.shape[-1]
        if split.repeat > 1:  # fewer KV heads than ranks: one (repeated) KV head per rank
            k, v = k.repeat_interleave(split.repeat, dim=1), v.repeat_interleave(split.repeat, dim=1)
        # [rows, S, heads-of-rank, D] -> [S, rows, ...]: the block for rank j is its heads of my rows.
        blocks = [x.view(mine, size, heads, d) for x, heads in ((q, split.q), (k, split.kv), (v, split.kv))]
        packed = torch.cat(blocks, dim=2).transpose(0, 1)
        width = split.q + 2 * split.kv
        full = self.comm.all_to_all_rows(packed.reshape(size * mine, width, d), [mine] * size, self.rows)
        q_full, k_full, v_full = full.split([split.q, split.kv, split.kv], dim=1)
        out = attend_fn(
            q_full.contiguous(), torch.cat([k_und, k_full], dim=0), torch.cat([v_und, v_full], dim=0)
        )  # [L, H/S * D]
        back = self.comm.all_to_all_rows(out.contiguous(), self.rows, [mine] * size)
        # [S, rows, H/S * D] from ranks 0..S-1 -> [rows, S * H/S * D]: heads in their original order.
        return back.view(size, mine, split.q * d).transpose(0, 1).reshape(mine, size * split.q * d)
