"""Batched layer halves vs the per-branch ones, bit for bit, under the project's CPU numerics policy.

What the project relies on (docs/numerics.md): with MKL's strict CNR (`MKL_CBWR=AUTO,STRICT`, which
`import cosmos3_batch` sets), a float32 GEMM row computed in a call of >= 16 rows has the same bits as
inside any larger call, at any thread count. So a layer half batched over branches of >= 16 rows each
equals the per-branch path, and these tests hold on every x86-64 CPU. Which row counts below 16 differ
(1-token images, say) is the BLAS's and the CPU's business, not asserted here: scripts/bench/gemm_rows.py
measures it, and because it differs somewhere, `batching_is_exact` stays False on CPU.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from cosmos3_batch.model.batched import (
    batch_by_default,
    batching_is_exact,
    gen_layer_batched,
    row_groups,
    und_layer_batched,
)
from cosmos3_batch.model.cosmos3 import BranchSeq, Cosmos3Split
from cosmos3_batch.pipeline.kinds.context import load_context

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    # torchrun sets OMP_NUM_THREADS=1; the plain test run uses both cores. Both are in the contract.
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def split(tiny_ckpt) -> Cosmos3Split:
    return load_context(tiny_ckpt, torch.device("cpu")).split


def make_seq(split: Cosmos3Split, und_len: int, gen_len: int, generator: torch.Generator) -> BranchSeq:
    # Text on the diagonal, then one frame of a near-square grid: the packer's layout for an image.
    width = max(1, math.isqrt(gen_len))
    t = torch.arange(gen_len)
    gen_pos = torch.stack([torch.full((gen_len,), und_len), und_len + t // width, und_len + t % width])
    positions = torch.cat([torch.arange(und_len).expand(3, -1), gen_pos], dim=1)
    rot_und, rot_gen = split.rotary(positions, und_len, torch.device("cpu"))
    hidden = split.config.hidden_size
    text = torch.randn(und_len, hidden, generator=generator)
    gen = torch.randn(gen_len, hidden, generator=generator)
    return BranchSeq(text, text, rot_und, rot_gen, torch.arange(gen_len), [], gen)


def both_ways(split: Cosmos3Split, und_lens: list[int], gen_lens: list[int]):
    """Runs every layer's UND then GEN half per branch and batched from the same inputs.

    Returns (UND K/V bit-equal, GEN outputs bit-equal). The batched GEN half is fed the
    per-branch K/V and is re-synced after each layer, so each verdict is that of one layer half alone.
    """
    generator = torch.Generator().manual_seed(0)
    base = [make_seq(split, u, n, generator) for u, n in zip(und_lens, gen_lens, strict=True)]
    per, bat = [replace(s, und_kv=[]) for s in base], [replace(s, und_kv=[]) for s in base]
    layers = split.transformer.layers
    und_equal = gen_equal = True
    for index, layer in enumerate(layers):
        is_last = index == len(layers) - 1
        for seq in per:
            split.und_layer(layer, seq, is_last)
        und_layer_batched(split, layer, bat, is_last)
        for p, b in zip(per, bat, strict=True):
            (k_p, v_p), (k_b, v_b) = p.und_kv[-1], b.und_kv[-1]
            und_equal &= torch.equal(k_p, k_b) and torch.equal(v_p, v_b)
            if not is_last:
                und_equal &= torch.equal(p.und_hidden, b.und_hidden)
                b.und_hidden = p.und_hidden
            assert b.und_hidden is None if is_last else b.und_hidden is not None
    for p, b in zip(per, bat, strict=True):
        b.und_kv = p.und_kv
    for index, layer in enumerate(layers):
        for seq in per:
            split.gen_layer(layer, seq, index)
        gen_layer_batched(split, layer, bat, index)
        for p, b in zip(per, bat, strict=True):
            gen_equal &= torch.equal(p.gen_hidden, b.gen_hidden)
            b.gen_hidden = p.gen_hidden
    return und_equal, gen_equal


def chained(split: Cosmos3Split, und_lens: list[int], gen_lens: list[int]) -> bool:
    """Every layer's UND then GEN half per branch and batched, never re-synced: all K/V and the last GEN
    outputs equal? From the second layer on the batched path reads its own previous output in place."""
    generator = torch.Generator().manual_seed(5)
    per = [make_seq(split, u, n, generator) for u, n in zip(und_lens, gen_lens, strict=True)]
    bat = [replace(s, und_kv=[]) for s in per]
    layers = split.transformer.layers
    for index, layer in enumerate(layers):
        for seq in per:
            split.und_layer(layer, seq, index == len(layers) - 1)
        und_layer_batched(split, layer, bat, index == len(layers) - 1)
    same = all(
        torch.equal(kp, kb) and torch.equal(vp, vb)
        for p, b in zip(per, bat, strict=True)
        for (kp, vp), (kb, vb) in zip(p.und_kv, b.und_kv, strict=True)
    )
    for index, layer in enumerate(layers):
        for seq in per:
            split.gen_layer(layer, seq, index)
        gen_layer_batched(split, layer, bat, index)
        # The outputs lie end to end in one buffer: what lets the next layer skip the copy.
        assert len({s.gen_hidden.untyped_storage().data_ptr() for s in bat}) == 1
    return same and all(torch.equal(p.gen_hidden, b.gen_hidden) for p, b in zip(per, bat, strict=True))


# ---- the layer halves over the tiny checkpoint's real layers ----------------------------------------


@pytest.mark.parametrize("branches", [2, 8])
@pytest.mark.parametrize("rows", [17, 64, 256, 1024])
def test_batched_halves_are_bit_exact_at_realistic_row_counts(split, threads, rows, branches):
    assert both_ways(split, [rows] * branches, [rows] * branches) == (True, True)


def test_batched_halves_are_bit_exact_with_mixed_sizes(split, threads):
    # Prompts of different lengths (cond/uncond), images and videos of different token counts: all >= 16 rows.
    und = [40, 31, 77, 60, 120, 97, 18, 16]
    gen = [17, 1024, 64, 256, 100, 33, 700, 16]
    assert both_ways(split, und, gen) == (True, True)
    assert chained(split, und, gen)


def test_one_branch_is_the_per_branch_path(split):
    generator = torch.Generator().manual_seed(1)
    seq = make_seq(split, 12, 5, generator)
    ref = replace(seq, und_kv=[])
    layer = split.transformer.layers[0]
    split.und_layer(layer, ref, False)
    und_layer_batched(split, layer, [seq], False)
    split.gen_layer(layer, ref, 0)
    gen_layer_batched(split, layer, [seq], 0)
    assert torch.equal(seq.gen_hidden, ref.gen_hidden) and torch.equal(seq.und_kv[0][0], ref.und_kv[0][0])
    gen_layer_batched(split, layer, [], 0)  # nothing to do is not an error
    und_layer_batched(split, layer, [], False)


def test_branches_do_not_see_each_other(split):
    # Attention is per sequence: changing one branch's rows changes no other branch's output.
    generator = torch.Generator().manual_seed(2)
    seqs = [make_seq(split, 20, 30, generator) for _ in range(3)]
    layer = split.transformer.layers[0]
    und_layer_batched(split, layer, seqs, False)
    outs = []
    for poke in (0.0, 1.0):
        trial = [replace(s) for s in seqs]  # shares the cached K/V, own gen_hidden slot
        trial[1].gen_hidden = trial[1].gen_hidden + poke
        gen_layer_batched(split, layer, trial, 0)
        outs.append([s.gen_hidden for s in trial])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][2], outs[1][2])
    assert not torch.equal(outs[0][1], outs[1][1])


def test_row_groups_keep_order_within_a_row_budget():
    seqs = [object() for _ in range(6)]
    rows = [1024, 100, 300, 200, 1024, 5]
    groups = row_groups(seqs, rows, max_rows=512)  # type: ignore[arg-type]
    assert [[seqs.index(s) for s in g] for g in groups] == [[0], [1, 2], [3], [4], [5]]
    assert row_groups(seqs, rows, max_rows=None) == [seqs]  # type: ignore[arg-type]
    assert row_groups([], [], max_rows=512) == []


def test_cached_und_kv_owns_its_memory(split):
    # Requests prefilled together finish at different passes: a cached K/V must not pin the batch's buffer.
    generator = torch.Generator().manual_seed(3)
    seqs = [make_seq(split, n, 4, generator) for n in (10, 30)]
    und_layer_batched(split, split.transformer.layers[0], seqs, False)
    for seq in seqs:
        for tensor in seq.und_kv[0]:
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


class _OutOfMemory(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")


def test_a_failed_batch_leaves_every_branch_as_it_was(split):
    # So the runner can retry the branches one by one and fail only the request that does not fit.
    layer = copy.deepcopy(split.transformer.layers[0])
    layer.mlp, layer.mlp_moe_gen = _OutOfMemory(), _OutOfMemory()
    generator = torch.Generator().manual_seed(6)
    seqs = [make_seq(split, n, 8, generator) for n in (10, 30)]
    before = [(s.und_hidden, s.gen_hidden) for s in seqs]
    with pytest.raises(RuntimeError, match="simulated"):
        und_layer_batched(split, layer, seqs, False)
    for seq, (und, gen) in zip(seqs, before, strict=True):
        assert seq.und_hidden is und and seq.gen_hidden is gen and seq.und_kv == []
    und_layer_batched(split, split.transformer.layers[0], seqs, False)
    with pytest.raises(RuntimeError, match="simulated"):
        gen_layer_batched(split, layer, seqs, 0)
    assert all(s.gen_hidden is g for s, (_, g) in zip(seqs, before, strict=True))


def test_und_batched_refuses_a_cached_branch(split):
    generator = torch.Generator().manual_seed(4)
    seqs = [make_seq(split, 8, 4, generator) for _ in range(2)]
    seqs[1].und_hidden = None
    with pytest.raises(AssertionError, match="cached"):
        und_layer_batched(split, split.transformer.layers[0], seqs, False)


def test_policy_keeps_the_exact_path_on_cpu():
    assert batching_is_exact(torch.device("cpu"), torch.float32) is False
    assert batching_is_exact("cpu", torch.bfloat16) is False
    assert batch_by_default("cpu", torch.float32) is False
    # Off CPU there is no bit-for-bit contract: batching is the throughput default there.
    assert batch_by_default(torch.device("cuda"), torch.bfloat16) is True
