"""Sequence parallelism (`--sp S`, DESIGN.md §11): which ranks form a group, how a request's GEN tokens
split over it, which heads each rank attends for, and what it costs. No torch: `plan` and the checks
that run before any weight is read use it, and so does the model's Ulysses attention (model/ulysses.py).

A group is S consecutive ranks. Within it, every rank runs the same requests; each holds a contiguous
slice of every branch's GEN rows for the token-wise ops (norms, projections, MLP), and, between two
all-to-alls, the whole sequence for H/S of the heads. The groups are the "ranks" of the pass protocol
(DESIGN.md §4); the weights stay sharded 1/N over all N ranks and every rank takes part in every fetch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosmos3_batch.model.heads import HeadSplit, head_split

# Fewest GEN rows a rank is given (unless the branch is shorter; then fewer ranks get rows). Why: a CPU
# sgemm may round a row differently when the call has few rows (MKL picks kernels by M, and where the cut
# lies depends on the CPU: 1-3 rows on an AVX2 EPYC, up to 15 on an AVX512 Xeon; scripts/bench/gemm_rows.py
# measures it), so a 2-row shard would not reproduce the reference's full-sequence GEMM bit for bit. From 16
# rows on it does under the project's CPU numerics policy (MKL strict CNR, docs/numerics.md), whatever the
# thread count; and a shard shorter than that is too small a GEMM to be worth a rank on any device anyway.
MIN_SHARD_ROWS = 16


def check_world(sp: int, world_size: int) -> int:
    """The number of DP groups; ValueError when --sp does not divide the world."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"--sp {sp} must divide the number of ranks ({world_size})")
    return world_size // sp


def check_model(sp: int, transformer_config: dict) -> HeadSplit:
    return head_split(
        int(transformer_config["num_attention_heads"]),
        int(transformer_config.get("num_key_value_heads") or transformer_config["num_attention_heads"]),
        sp,
    )


def group_ranks(world_size: int, sp: int) -> list[list[int]]:
    """The groups: S consecutive ranks each, so they share a node whenever S divides the ranks per node."""
    check_world(sp, world_size)
    return [list(range(start, start + sp)) for start in range(0, world_size, sp)]


def spans_nodes(sp: int, ranks_per_node: int) -> bool:
    """Whether some group's all-to-alls would cross the network (S does not divide the ranks per node)."""
    return sp > 1 and ranks_per_node % sp != 0


def shard_rows(rows: int, sp: int, min_rows: int = MIN_SHARD_ROWS) -> list[int]:
    """Rows of a `rows`-long GEN stream held by each of the S ranks: contiguous, in rank order, as equal
    as possible, none below `min_rows` (the first ranks take them when the stream is short). No padding:
    the all-to-alls carry uneven row counts, so no padded token exists to be masked out."""
    used = max(1, min(sp, rows // min_rows)) if rows else 1
    base, extra = divmod(rows, used)
    sizes = [base + (1 if i < extra else 0) for i in range(used)]
    return sizes + [0] * (sp - used)


@dataclass(frozen=True)
class SpCost:
    """Per rank, per pass, at --sp S: the activations it holds and the extra time the all-to-alls take."""

    activation_bytes: int
    all_to_all_bytes: int  # sent by one rank per pass (received the same)
    all_to_all_s: float


def sp_cost(
    dims: dict, sp: int, work: tuple[int, int, int, int], layers: int, act_bytes: int, gbps: float
) -> SpCost:
    """dims: hidden, heads, kv_heads, head_dim, intermediate; work: (sequences, GEN tokens, UND tokens,
    requests held with their UND K/V). Kept: each rank holds the UND K/V of its own KV heads and 1/S of
    the GEN rows; transient: the token-wise ops on L/S rows, attention on L rows for H/S heads, and the head
    reading the full stream once it is gathered back."""
    sequences, gen, und, held = work
    split = head_split(dims["heads"], dims["kv_heads"], sp)
    d, hidden = dims["head_dim"], dims["hidden"]
    local = -(-gen // sp)
    kept = held * (layers * und * split.kv * d * 2) + sequences * local * hidden
    token_ops = local * (dims["intermediate"] * 3 + (dims["heads"] + 2 * dims["kv_heads"]) * d + 2 * hidden)
    attention = gen * (split.q + 2 * split.kv) * d + (und + gen) * 2 * split.kv * d
    transient = max(token_ops + attention, gen * hidden * 2)
    # Per layer per branch: q|k|v to the heads' owners, the attention output back; (S-1)/S of it leaves.
    sent = 0 if sp == 1 else local * ((split.q * sp + 2 * split.kv * sp) * d + dims["heads"] * d)
    sent = sent * (sp - 1) // sp if sp > 1 else 0
    per_pass = sequences * layers * sent * act_bytes
    return SpCost((kept + transient) * act_bytes, per_pass, per_pass / (gbps * 1e9) if gbps else 0.0)
