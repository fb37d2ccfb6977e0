"""A Transfer chain's chunk boundaries run off the pass loop (DESIGN.md §17, kinds/transfer/chain.py): the
chain keeps its slot and computes nothing for exactly `--chunk-gap-passes` passes while the finisher thread
decodes the chunk and encodes the next one; the other requests keep using those passes; the outputs do not
depend on the gap; the passes are what plan's simulator counts; a boundary that fails fails its chain
alone."""

from __future__ import annotations

import threading

import imageio
import numpy as np
import pytest
import torch

from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.kinds.transfer import chunks as transfer_chunks
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.plan.branches import sim_request
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import simulate
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import moving_square, write_jsonl

STEPS = 2
# 25 frames in chunks of 9 overlapping by 1: 3 chunks, 2 boundaries.
CHAIN = {"id": "chain", "prompt": "night", "control": {"edge": "long.mp4"}, "frames_per_chunk": 9,
         "size": "48x32", "num_inference_steps": STEPS, "guidance_scale": 2.0, "seed": 5}  # fmt: skip
# Long enough to be active through both boundaries of the chain.
T2V = {"id": "t2v", "prompt": "a cat", "num_frames": 1, "size": "32x32", "num_inference_steps": 12, "seed": 7}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("boundary")
    moving = moving_square(25)
    imageio.mimwrite(folder / "long.mp4", moving, fps=8)
    return folder


@pytest.fixture(scope="module")
def ctx(tiny_ckpt):
    return load_context(tiny_ckpt, torch.device("cpu"))


def _requests(folder, rows):
    requests, errors = load_requests(str(write_jsonl(folder / "r.jsonl", rows)))
    assert errors == []
    return requests


def _run(ctx, requests, gap: int, max_active: int):
    results, errors = {}, {}

    def on_finished(job, result, error):
        (results if error is None else errors)[job.request.id] = result if error is None else error

    rule = PrefillRule(chunk_gap=gap)
    runner = PassRunner(ctx, ResidentWeights(ctx.layers), max_active, on_finished, rule=rule)
    runner.run(requests)
    return results, errors, runner


def _simulated(requests, gap: int, max_active: int):
    return simulate([[sim_request(r, gap) for r in requests]], max_active, PrefillRule(chunk_gap=gap))


def test_a_lone_chain_sits_out_exactly_the_gap_and_its_bits_do_not_depend_on_it(ctx, folder, monkeypatch):
    requests = _requests(folder, [CHAIN])
    assert requests[0].transfer.num_chunks == 3
    threads = []
    real = transfer_chunks.decode_chunk

    def decode_chunk(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(transfer_chunks, "decode_chunk", decode_chunk)
    outputs = {}
    for gap in (0, 1, 3):
        threads.clear()
        results, errors, runner = _run(ctx, requests, gap, max_active=1)
        assert errors == {}
        outputs[gap] = results["chain"]
        # Three chunks of STEPS steps, and `gap` passes at each of the two boundaries; on those nothing
        # anywhere computes, so no layer is walked or fetched.
        assert runner.passes == 3 * STEPS + 2 * gap
        assert runner.skipped_passes == 2 * gap
        assert [p.computed for p in runner.timeline].count(0) == 2 * gap
        sim = _simulated(requests, gap, 1)
        assert (sim.passes, sim.und_passes, sim.skipped_passes) == (runner.passes, runner.und_passes, 2 * gap)
        # Every chunk decoded on the finisher's thread: the two boundaries and the final one.
        assert len(threads) == 3 and all(name.startswith("finisher") for name in threads), threads
        assert runner.forwards[0] == 3 * STEPS * 2  # cond and uncond every step: the gap computed nothing
    for gap in (1, 3):
        assert torch.equal(outputs[gap].latents, outputs[0].latents)
        assert np.array_equal(outputs[gap].frames, outputs[0].frames)


def test_other_requests_use_the_passes_while_a_boundary_is_crossed(ctx, folder):
    requests = _requests(folder, [CHAIN, T2V])
    results, errors, runner = _run(ctx, requests, gap=2, max_active=2)
    assert errors == {} and sorted(results) == ["chain", "t2v"]
    # The T2V request computed on every pass of the chain's gaps: no pass was skipped, and 4 passes ran with
    # both requests active but only the T2V's one branch (guidance 6 by default: 2 branches) computing.
    assert runner.skipped_passes == 0
    assert sum(1 for p in runner.timeline if p.active == 2 and p.computed == 2) == 2 * 2
    sim = _simulated(requests, 2, 2)
    assert (sim.passes, sim.und_passes) == (runner.passes, runner.und_passes)


def test_a_boundary_that_fails_fails_its_chain_alone(ctx, folder, monkeypatch):
    requests = _requests(folder, [CHAIN, T2V])
    real = transfer_chunks.chunk_inputs
    calls = []

    def chunk_inputs(*args):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # the first boundary's encode, on the finisher thread
            raise OSError("disk read failed")
        return real(*args)

    monkeypatch.setattr(transfer_chunks, "chunk_inputs", chunk_inputs)
    results, errors, _ = _run(ctx, requests, gap=1, max_active=2)
    assert sorted(results) == ["t2v"]
    assert errors == {"chain": "OSError: disk read failed"}
    assert calls[1].startswith("finisher")


def test_a_non_finite_chunk_fails_its_chain_at_the_boundary(ctx, folder, monkeypatch):
    requests = _requests(folder, [CHAIN, T2V])
    real = transfer_chunks.combine

    def combine(preds, step):
        return real(preds, step) * float("nan")  # every step of the chain: its first chunk ends non-finite

    monkeypatch.setattr(transfer_chunks, "combine", combine)
    results, errors, _ = _run(ctx, requests, gap=1, max_active=2)
    assert sorted(results) == ["t2v"]
    assert errors == {"chain": "RequestFailed: chunk 0: latents contain NaN or inf; nothing was written"}


def test_the_ranks_that_write_nothing_keep_no_pieces(ctx, folder):
    """An --sp group's other ranks cross every boundary too (they need the tail) but keep no piece."""
    from cosmos3_batch.pipeline.kinds.transfer.chain import TransferJob

    (chain,) = _requests(folder, [CHAIN])
    job = TransferJob(ctx, chain)
    job.keeps_output = False
    job.prepare()
    for _ in range(3 * STEPS):
        job.rejoin()  # no layers: the heads read the GEN stream as embedded
        job.begin_step()
        job.finish_step()
    assert job.chunk_id == 2 and job.done
    assert job.pieces == [] and job.chunk_latents == [] and job.vae_calls["decodes"] == 2


def test_a_chains_files_are_read_and_prepared_off_the_loop_thread(ctx, folder, monkeypatch):
    """Issue 48: reading a Transfer request's controls and preprocessing them (seconds of host work for a
    long clip) happen ahead of its admission on the transfer-inputs thread, never on the pass loop's, where
    every other rank would wait for them at the next exchange; the bits are those of inline preparation."""
    from cosmos3_batch.pipeline.kinds.transfer.inputs import AheadOfAdmission

    requests = _requests(folder, [T2V, CHAIN, {**CHAIN, "id": "chain2", "seed": 6}])
    threads: list[tuple[str, str]] = []
    for name in ("prepare_controls", "load_control"):
        real = getattr(transfer_chunks, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            threads.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(transfer_chunks, name, recorded)
    ahead, errors, _ = _run(ctx, requests, gap=2, max_active=1)
    assert errors == {}
    off_loop = sorted(threads)
    assert [what for what, _ in off_loop] == ["load_control"] * 2 + ["prepare_controls"] * 2
    assert all(thread.startswith("transfer-inputs") for _, thread in off_loop), off_loop
    threads.clear()
    monkeypatch.setattr(AheadOfAdmission, "look", lambda self, queue: None)  # nothing started ahead
    inline, errors, _ = _run(ctx, requests, gap=2, max_active=1)
    assert errors == {} and {thread for _, thread in threads} == {threading.main_thread().name}
    for rid in ("chain", "chain2"):
        assert torch.equal(ahead[rid].latents, inline[rid].latents)
