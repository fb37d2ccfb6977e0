"""Batched branches: one layer half applied to many `BranchSeq`s with their rows concatenated.

`Cosmos3Split.gen_layer` / `und_layer` run one branch at a time, so at K active requests with CFG a layer
part costs 2K small GEMM sets. Every op of a layer half except attention is token-wise (RMS norms, the
q/k/v/out projections, rotary, the MLP), so the branches can share one GEMM per projection: concatenate
their rows, run the token-wise ops once, split. Attention stays per sequence, exactly as the per-branch
path calls it, so a branch only ever attends to its own UND K/V and its own GEN tokens.

Same submodules, same ops, same order as cosmos3.py. That makes the batched path *mathematically* equal to
the per-branch one, but not always bit-equal: a GEMM's kernel (and with it the reduction order of a row)
may depend on the row count M. `batching_is_exact` / `batch_by_default` are the policy the runner reads;
the measurements behind them are in tests/unit/test_batched.py. `row_groups` caps the rows per batch:
on CPU, batching pays for short branches only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cosmos3_batch.model.cosmos3 import BranchSeq, Cosmos3Split, _apply_rotary, _attention, gen_attention


@contextmanager
def _sequences(split: Cosmos3Split, sizes: list[int]) -> Iterator[None]:
    """FP8: W8A8 scales each sequence's rows by their own amax (model/fp8.py), so tell it where they lie."""
    fp8 = split.fp8
    if fp8 is None:
        yield
        return
    fp8.segments = sizes
    try:
        yield
    finally:
        fp8.segments = None


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(rows), without the copy when they already lie end to end in one buffer (as the previous
    layer's batched output leaves them): a 16 MB copy per layer saved at 8 x 1k tokens of hidden 512."""
    first = rows[0]
    offset, width = first.storage_offset(), first.shape[1:].numel()
    storage = first.untyped_storage().data_ptr()
    for t in rows:
        adjacent = t.untyped_storage().data_ptr() == storage and t.storage_offset() == offset
        if not adjacent or not t.is_contiguous() or t.dtype != first.dtype:
            return torch.cat(rows)
        offset += t.numel()
    total = sum(t.shape[0] for t in rows)
    return first.as_strided((total, *first.shape[1:]), (width, *first.stride()[1:]))


def _cat_rotary(seqs: list[BranchSeq], which: str) -> tuple[torch.Tensor, torch.Tensor]:
    # cos/sin are per-token, broadcast over heads: concatenating along tokens gives each row its own pair.
    pairs = [getattr(s, which) for s in seqs]
    return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])


def _project(attn: torch.nn.Module, x: torch.Tensor, names: tuple[str, str, str]):
    q = getattr(attn, names[0])(x).view(-1, attn.num_attention_heads, attn.head_dim)
    k = getattr(attn, names[1])(x).view(-1, attn.num_key_value_heads, attn.head_dim)
    v = getattr(attn, names[2])(x).view(-1, attn.num_key_value_heads, attn.head_dim)
    return q, k, v


def gen_layer_batched(
    split: Cosmos3Split, layer: torch.nn.Module, seqs: list[BranchSeq], layer_index: int
) -> None:
    """GEN half of one layer for every branch in `seqs` at once; each `seq.gen_hidden` is replaced.

    Equals `split.gen_layer(layer, seq, layer_index)` per seq up to GEMM row-invariance (see module doc).
    """
    if not seqs:
        return
    if len(seqs) == 1:
        # Nothing to share: the per-branch path is the same work and is exact by construction.
        split.gen_layer(layer, seqs[0], layer_index)
        return
    sizes = [s.gen_hidden.shape[0] for s in seqs]
    with _sequences(split, sizes):
        out = _gen_rows(split, layer, seqs, sizes, layer_index)
    # Written only now (a failed batch leaves every branch as it was, so the caller can retry per branch).
    # Views into one buffer: every seq in a pass is replaced at the next layer, so none outlives the others
    # by more than a layer, and the head reads its rows by index.
    for seq, rows in zip(seqs, out.split(sizes), strict=True):
        seq.gen_hidden = rows


def _gen_rows(split: Cosmos3Split, layer, seqs: list[BranchSeq], sizes: list[int], layer_index: int):
    attn = layer.self_attn
    hidden = _joined([s.gen_hidden for s in seqs])
    x = layer.input_layernorm_moe_gen(hidden)
    q, k, v = _project(attn, x, ("add_q_proj", "add_k_proj", "add_v_proj"))
    rot = _cat_rotary(seqs, "rot_gen")
    q = _apply_rotary(attn.norm_added_q(q), rot)
    k = _apply_rotary(attn.norm_added_k(k), rot)
    # Per sequence: its own UND prefix + its own GEN tokens, the same call gen_layer makes.
    outs = [
        gen_attention(attn, seq, q_s, k_s, v_s, layer_index)
        for seq, q_s, k_s, v_s in zip(seqs, q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
    ]
    residual = hidden + attn.to_add_out(torch.cat(outs))
    return residual + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(residual))


def und_layer_batched(
    split: Cosmos3Split, layer: torch.nn.Module, seqs: list[BranchSeq], is_last: bool
) -> None:
    """UND half of one layer for every branch in `seqs` (all must still need UND): caches each branch's
    (K, V) for this layer and advances its UND stream, like `split.und_layer` per seq."""
    if not seqs:
        return
    assert all(s.needs_und for s in seqs), "und_layer_batched given a branch whose UND K/V are cached"
    if len(seqs) == 1:
        split.und_layer(layer, seqs[0], is_last)
        return
    sizes = [s.und_hidden.shape[0] for s in seqs]
    with _sequences(split, sizes):
        kv, new_hidden = _und_rows(layer, seqs, sizes, is_last)
    # Nothing is written until everything is computed: if a batch fails (out of memory), every branch is
    # as it was and the caller can retry them one by one to find the failing request.
    for seq, pair, rows in zip(seqs, kv, new_hidden, strict=True):
        seq.und_kv.append(pair)
        seq.und_hidden = rows


def _und_rows(layer, seqs: list[BranchSeq], sizes: list[int], is_last: bool):
    attn = layer.self_attn
    hidden = _joined([s.und_hidden for s in seqs])
    x = layer.input_layernorm(hidden)
    q, k, v = _project(attn, x, ("to_q", "to_k", "to_v"))
    k = attn.norm_k(k)
    rot = _cat_rotary(seqs, "rot_und")
    k_rot = _apply_rotary(k, rot)
    k_gen = k_rot if attn.k_norm_und_for_gen is None else _apply_rotary(attn.k_norm_und_for_gen(k), rot)
    # The cache lives as long as its request, and requests prefilled together finish at different passes:
    # clone each branch's slice so one finished request does not pin the whole batch's K/V.
    kv = [
        (k_s.clone(), v_s.clone()) if seq.shard is None else seq.shard.own_kv(k_s, v_s)
        for seq, k_s, v_s in zip(seqs, k_gen.split(sizes), v.split(sizes), strict=True)
    ]
    if is_last:
        # The last layer's UND output feeds nothing the vision head reads: only its K/V matter.
        new_hidden: list[torch.Tensor | None] = [None] * len(seqs)
    else:
        q = _apply_rotary(attn.norm_q(q), rot)
        outs = [
            # Causal within each branch only: a branch never sees another's text.
            _attention(attn, q_s, k_s, v_s, causal=True)
            for q_s, k_s, v_s in zip(q.split(sizes), k_rot.split(sizes), v.split(sizes), strict=True)
        ]
        residual = hidden + attn.to_out(torch.cat(outs))
        new_hidden = list((residual + layer.mlp(layer.post_attention_layernorm(residual))).split(sizes))
    return kv, new_hidden


def row_groups(seqs: list[BranchSeq], rows: list[int], max_rows: int | None) -> list[list[BranchSeq]]:
    """Consecutive groups of `seqs` of at most `max_rows` rows each (a longer seq alone); None: one group.

    Batching pays where a branch's GEMMs are short (few rows); at ~1k rows a branch's GEMM is already
    efficient, and joining 8 of them only makes the memory-bound elementwise ops run on 8x the working set
    (measured on CPU, scripts/bench/batched.py: 1.2x slower). A row budget keeps the gain without that.
    """
    groups: list[list[BranchSeq]] = []
    total = 0
    for seq, n in zip(seqs, rows, strict=True):
        if groups and (max_rows is None or total + n <= max_rows):
            groups[-1].append(seq)
            total += n
        else:
            groups.append([seq])
            total = n
    return groups


def batching_is_exact(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the batched halves are bit-identical to the per-branch ones whatever the row counts.

    False on CPU: even under strict CNR (docs/numerics.md) sgemm gives a row of a call with very few rows
    other bits than the same row inside a larger call (measured: 1-3 rows on an AVX2 EPYC, more on other
    CPUs; scripts/bench/gemm_rows.py), and the reference runs each branch alone, so a 1-token image batched
    with others would lose its bits. From 16 rows a branch on, strict CNR makes batching exact (the tests
    hold that), but the per-branch path is the only one exact for every request. bfloat16 runs through
    oneDNN, which CNR does not govern: no exemption. Off CPU nothing is claimed either (cuBLAS also picks
    kernels by M); there the contract is not bit-for-bit, which is what `batch_by_default` reads.
    """
    # No (device, dtype) measured so far is row-invariant for every M; the arguments let one that is say so.
    return False


def batch_by_default(device: torch.device | str, dtype: torch.dtype) -> bool:
    """The runner's default: batch off CPU (no bit-for-bit contract there), on CPU only where exact."""
    return torch.device(device).type != "cpu" or batching_is_exact(device, dtype)
