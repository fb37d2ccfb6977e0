"""--sp in one process: the shard and head rules, the CPU GEMM fact the shard rule rests on, Ulysses
attention over S threads standing in for ranks, and the exit-2 checks before anything loads."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model.cosmos3 import _attention
from cosmos3_batch.model.heads import HeadSplit, head_split
from cosmos3_batch.model.ulysses import SeqShard
from cosmos3_batch.parallel.sequence import MIN_SHARD_ROWS, check_world, group_ranks, shard_rows, spans_nodes
from tests.conftest import write_jsonl


@pytest.mark.parametrize(
    ("rows", "sp", "expected"),
    [
        (0, 4, [0, 0, 0, 0]),
        (1, 2, [1, 0]),
        (15, 2, [15, 0]),  # shorter than two minimum shards: one rank takes it all
        (32, 2, [16, 16]),
        (33, 2, [17, 16]),
        (40, 4, [20, 20, 0, 0]),
        (63, 4, [21, 21, 21, 0]),
        (96, 4, [24, 24, 24, 24]),
        (44160, 4, [11040] * 4),  # 1280x720, 189 frames
    ],
)
def test_shard_rows(rows, sp, expected):
    assert shard_rows(rows, sp) == expected
    assert sum(expected) == rows


def test_head_split_divides_or_repeats_kv_heads():
    assert head_split(4, 2, 1) == HeadSplit(4, 2, 1)
    assert head_split(4, 2, 2) == HeadSplit(2, 1, 1)
    assert head_split(8, 8, 4) == HeadSplit(2, 2, 1)
    assert head_split(8, 2, 4) == HeadSplit(2, 1, 2)  # 2 KV heads over 4 ranks: each sent to 2 ranks
    assert head_split(40, 8, 8) == HeadSplit(5, 1, 1)
    assert head_split(40, 8, 4) == HeadSplit(10, 2, 1)


@pytest.mark.parametrize(("heads", "kv", "sp"), [(4, 2, 3), (8, 2, 3), (8, 4, 6), (12, 4, 8)])
def test_head_split_names_sp_and_the_head_counts(heads, kv, sp):
    with pytest.raises(ValueError) as err:
        head_split(heads, kv, sp)
    message = str(err.value)
    assert f"--sp {sp}" in message
    assert f"{heads} attention heads and {kv} key/value heads" in message


def test_groups_are_consecutive_ranks():
    assert group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(3, 1) == [[0], [1], [2]]
    assert check_world(2, 8) == 4
    with pytest.raises(ValueError, match=r"--sp 3 must divide the number of ranks \(4\)"):
        check_world(3, 4)
    assert not spans_nodes(4, 8) and spans_nodes(4, 2) and not spans_nodes(1, 3)


@pytest.mark.exact
@pytest.mark.parametrize("k", [64, 128, 512])
def test_gemm_rows_do_not_depend_on_the_row_count_from_min_shard_rows(k):
    """Why MIN_SHARD_ROWS: at one thread (torchrun's), a row of x @ W.T computed within a shard of >= 16
    rows is bit-identical to the same row within the whole sequence, for every split we make. (Below it,
    MKL's small-M kernel rounds differently: e.g. 1-row shards of K=64, 5-row shards of K=128.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(k)
        weight, bias = torch.randn(96, k, generator=gen), torch.randn(96, generator=gen)
        for rows in (16, 33, 64, 100, 257):
            x = torch.randn(rows, k, generator=gen)
            full = torch.nn.functional.linear(x, weight, bias)
            for sp in (2, 4):
                sizes = shard_rows(rows, sp)
                assert min(s for s in sizes if s) >= MIN_SHARD_ROWS or sizes[0] == rows
                parts = [torch.nn.functional.linear(p, weight, bias) for p in x.split(sizes)]
                assert torch.equal(torch.cat(parts), full), (rows, sp, sizes)
    finally:
        torch.set_num_threads(before)


class ThreadGroup:
    """S threads standing in for the ranks of a group: all_to_all_single's semantics over shared memory."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.boxes: list = [None] * size
        self.calls = 0

    def member(self, rank: int):
        group = self

        class Comm:
            size, calls = group.size, 0

            def __init__(self):
                self.rank = rank

            def all_to_all_rows(self, send, send_rows, recv_rows):
                group.boxes[rank] = list(send.split(send_rows))
                group.barrier.wait()
                out = torch.cat([group.boxes[src][rank] for src in range(group.size)])
                assert out.shape[0] == sum(recv_rows)
                group.barrier.wait()  # nobody overwrites a box before every rank has read its chunks
                Comm.calls += 1
                return out

        return Comm()


class FakeAttn:
    class processor:  # stands in for the attention module's processor attribute
        _attention_backend = None
        _parallel_config = None


@pytest.mark.exact
@pytest.mark.parametrize(
    ("heads", "kv", "sp", "rows"), [(4, 2, 2, 40), (8, 2, 4, 70), (8, 8, 4, 64), (4, 4, 4, 5)]
)
def test_ulysses_attention_equals_the_unsplit_call(heads, kv, sp, rows):
    gen = torch.Generator().manual_seed(rows)
    d, und = 8, 7
    q, k, v = (torch.randn(rows, h, d, generator=gen) for h in (heads, kv, kv))
    k_und, v_und = torch.randn(und, kv, d, generator=gen), torch.randn(und, kv, d, generator=gen)
    expected = _attention(FakeAttn, q, torch.cat([k_und, k]), torch.cat([v_und, v]), causal=False)
    group, sizes, outs = ThreadGroup(sp), shard_rows(rows, sp), [None] * sp
    split = head_split(heads, kv, sp)

    def rank_main(rank: int) -> None:
        shard = SeqShard(group.member(rank), sizes, split)
        mine = shard.local

        def attend(q_, k_, v_):
            return _attention(FakeAttn, q_, k_, v_, causal=False)

        outs[rank] = shard.attend(attend, q[mine].contiguous(), k[mine], v[mine], *shard.own_kv(k_und, v_und))
        assert torch.equal(shard.gather(outs[rank]), expected)  # the head's all-gather of the rows

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(sp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(torch.cat(outs), expected)


def test_sp_that_does_not_fit_the_heads_exits_2_before_loading(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a cat", "size": "32x32", "num_frames": 1}])
    result = CliRunner().invoke(app, ["run", str(prompts), "--out", str(tmp_path / "o"), "--sp", "3"])
    assert result.exit_code == 2
    assert "--sp 3" in result.output and "4 attention heads and 2 key/value heads" in result.output
    assert not (tmp_path / "o").exists()
    # One process is a world of one: --sp 2 fits the heads but not the ranks.
    result = CliRunner().invoke(app, ["run", str(prompts), "--out", str(tmp_path / "o"), "--sp", "2"])
    assert result.exit_code == 2 and "--sp 2 must divide the number of ranks (1)" in result.output


def test_plan_schedules_groups(tmp_path, tiny_ckpt):
    rows = [{"id": f"r{i}", "prompt": "x", "size": "128x128", "num_frames": 5} for i in range(5)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["plan", str(prompts), "--nproc", "4", "--sp", "2", "--model", str(tiny_ckpt), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["sp"] == 2 and len(doc["ranks"]) == 2  # two groups of two
    assert sorted(i for r in doc["ranks"] for i in r["ids"]) == [f"r{i}" for i in range(5)]
    est = doc["estimate"]
    assert est["sp"] == 2 and est["all_to_all_bytes_per_pass"] > 0
    one = json.loads(CliRunner().invoke(app, [*args[:5], "1", *args[6:]]).output)["estimate"]
    assert est["activation_bytes_per_rank"] < one["activation_bytes_per_rank"]
    bad = CliRunner().invoke(
        app, ["plan", str(prompts), "--nproc", "3", "--sp", "3", "--model", str(tiny_ckpt)]
    )
    assert bad.exit_code == 2 and "4 attention heads" in bad.output


@pytest.mark.exact
def test_w8a8_under_sp_takes_the_whole_sequence_amax():
    """W8A8 quantizes activations per tensor: under --sp each rank sees only its rows, so the amax is
    reduced over the group; with it every shard is quantized with the whole sequence's scale, without it
    with its own. A rank with no rows still takes part (with 0). Compared shard by shard with the same
    shard quantized at the whole's amax: whether a shard's FP8 GEMM rows equal the same rows of the whole's
    call is the CPU's business (oneDNN on AMX CPUs, outside MKL's CNR), not asserted here."""
    from cosmos3_batch.checkpoint.fp8_format import quantize_per_tensor
    from cosmos3_batch.model.fp8 import w8a8_linear

    gen = torch.Generator().manual_seed(1)
    q, _, scale = quantize_per_tensor(torch.randn(64, 32, generator=gen) * 0.05)
    x = torch.randn(70, 32, generator=gen)
    x[3] *= 10  # the largest activation lies in the first shard only
    sizes = [*shard_rows(70, 4), 0]  # a fifth rank holding nothing
    whole_amax = x.abs().amax()
    expected = [w8a8_linear(p, q, scale, None, input_amax=whole_amax) for p in x.split(sizes)]
    seen = []

    def group_max(amax: torch.Tensor) -> torch.Tensor:
        seen.append(float(amax))
        return whole_amax.reshape(amax.shape)  # what the group's all-reduce returns

    parts = [w8a8_linear(p, q, scale, None, amax_reduce=group_max) for p in x.split(sizes)]
    assert [torch.equal(a, b) for a, b in zip(parts, expected, strict=True)] == [True] * 5
    assert len(seen) == 5 and seen[-1] == 0.0
    alone = [w8a8_linear(p, q, scale, None) for p in x.split(sizes)]
    same = [torch.equal(a, b) for a, b in zip(alone, expected, strict=True)]
    assert same == [True, False, False, False, True]  # the shard holding the largest, and the empty one
