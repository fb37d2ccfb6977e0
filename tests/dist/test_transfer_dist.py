"""Transfer (DESIGN.md §17) under real torchrun (world 2, gloo, CPU), in one launch (tests/dist/jobs.py):
Transfer requests (one control and two, text and control guidance switched by intervals, 2- and 3-chunk
chains) mixed with T2V in one job, allgather and local at --max-active 1 and 4, sharded at 2, and one --sp 2
group with --vae-patch-parallel-size 2, at chunk gaps 0 to 3; equal to the references in this process bit for
bit (`Cosmos3OmniModularPipeline` for Transfer: every chunk's latents and the frames; `Cosmos3OmniPipeline`
for T2V); every rank issues the same collectives, and the layers ran exactly the forwards plan/branches.py
asks for, summed over the ranks; `plan`'s simulator predicts each run's passes, UND passes, bytes and slot
occupancy exactly, and `plan` counts the chunks and VAE calls the sidecars record."""

from __future__ import annotations

import json

import imageio
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.cli import app
from cosmos3_batch.model.vae_shards import plan_cut
from cosmos3_batch.plan.branches import texts_needed, transfer_plan
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import moving_square, write_jsonl
from tests.dist.jobs import CAPTURE_FRAMES, torchrun_jobs
from tests.dist.test_checkpoints import one_thread
from tests.dist.test_runs import assert_simulated
from tests.reference import reference_kwargs, transfer_outputs, transfer_reference

pytestmark = pytest.mark.dist

LAYERS = 2  # the tiny model's
BASE = {"size": "48x32", "num_inference_steps": 3}
ROWS = [
    {"id": "edge", "prompt": "a red car", "control": {"edge": "edge.mp4"}, "guidance_scale": 3.0, "seed": 1},
    # Both axes switched by their intervals: 1 to 3 forwards per step.
    {"id": "two", "prompt": "a wet road", "control": {"blur": "blur.mp4", "edge": "edge.mp4"},
     "guidance_scale": 4.0, "control_guidance": 2.0, "guidance_interval": [500, 1000],
     "control_guidance_interval": [0, 700], "seed": 2},
    # 17 frames in chunks of 9 overlapping by 1: 2 chunks.
    {"id": "chain", "prompt": "night", "control": {"edge": "long.mp4"}, "num_frames": 17,
     "frames_per_chunk": 9, "control_guidance": 1.5, "seed": 5},
    # Big enough for the sp2 launch's VAE group to split its encodes and decodes (plan_cut at one thread):
    # 9 frames in chunks of 5 overlapping by 2, so that a boundary's decode and encodes are the group's too.
    {"id": "wide", "prompt": "a field", "control": {"edge": "edge.mp4"}, "size": "128x128", "num_frames": 9,
     "frames_per_chunk": 5, "conditional_frames": 2, "num_inference_steps": 2, "guidance_scale": 1.0,
     "seed": 9},
    {"id": "t2v", "prompt": "a cat walks", "num_frames": 9, "seed": 7},
    {"id": "t2v-nocfg", "prompt": "a dog", "num_frames": 5, "guidance_scale": 1.0, "seed": 8},
]  # fmt: skip
# The chunk gap (passes a chain sits out at a boundary while the finisher thread crosses it) at its
# default (2), at 0 (the loop waits at once) and at 3: outputs equal, passes as plan's simulator says.
CONFIGS = {
    "ag1": ["--offload", "allgather", "--max-active", "1", "--chunk-gap-passes", "2"],
    "ag4": ["--offload", "allgather", "--max-active", "4", "--chunk-gap-passes", "3"],
    "local1": ["--offload", "local", "--max-active", "1", "--chunk-gap-passes", "0"],
    "local4": ["--offload", "local", "--max-active", "4", "--chunk-gap-passes", "2"],
    "sharded2": ["--offload", "sharded", "--max-active", "2", "--chunk-gap-passes", "2"],
    # One --sp group of both ranks: every GEN sequence ([controls..., target] too) split over them, the
    # first chunk's control and target encodes and the last chunk's decode shared by the group.
    "sp2": ["--offload", "allgather", "--max-active", "2", "--chunk-gap-passes", "1", "--sp", "2",
            "--vae-patch-parallel-size", "2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_ckpt):
    folder = tmp_path_factory.mktemp("transfer-dist")
    rng = np.random.RandomState(0)
    moving = moving_square(17)
    imageio.mimwrite(folder / "long.mp4", moving, fps=8)
    imageio.mimwrite(folder / "edge.mp4", moving[:9], fps=8)
    imageio.mimwrite(folder / "blur.mp4", [(rng.rand(32, 48, 3) * 255).astype(np.uint8)] * 9, fps=8)
    prompts = write_jsonl(folder / "p.jsonl", [{**BASE, **row} for row in ROWS])
    requests, errors = load_requests(str(prompts))
    assert errors == []

    def references():
        from diffusers import Cosmos3OmniPipeline

        out = transfer_outputs(transfer_reference(tiny_ckpt), requests)
        plain = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
        plain.set_progress_bar_config(disable=True)
        for r in requests:
            if r.transfer is None:
                generator = torch.Generator("cpu").manual_seed(r.seed)
                latents = plain(**reference_kwargs(r), generator=generator, output_type="latent").video
                out[r.id] = (latents.float(), None)
        return out

    return folder, prompts, requests, one_thread(references)


def planned_forwards(requests, scheduler_config) -> tuple[int, int]:
    """(GEN forwards, UND prefills) by plan/branches.py, over every chunk of every request."""
    from diffusers import UniPCMultistepScheduler

    total, texts = 0, 0
    for r in requests:
        if r.transfer is None:
            branches = 2 if r.guidance_scale != 1.0 else 1
            total, texts = total + r.num_inference_steps * branches, texts + branches
            continue
        scheduler = UniPCMultistepScheduler.from_config(scheduler_config)
        scheduler.set_timesteps(r.num_inference_steps)
        s = r.transfer
        plan = transfer_plan(scheduler.timesteps.tolist(), r.guidance_scale, s.control_guidance,
                             s.guidance_interval, s.control_guidance_interval)  # fmt: skip
        total += s.num_chunks * sum(step.count for step in plan)
        texts += len(texts_needed(plan))  # the chain keeps its texts' K/V across chunks
    return total, texts


def test_transfer_mixed_with_t2v_is_bit_exact_under_torchrun(setup, tiny_ckpt, cpu_branch):
    folder, prompts, requests, reference = setup
    chunks = {r.id: r.transfer.num_chunks for r in requests if r.transfer}
    assert chunks == {"edge": 1, "two": 1, "chain": 2, "wide": 3}
    encodes, decodes = split_counts(requests)  # the VAE cut depends on this CPU's measured GEMM step
    cpu_branch(f"Transfer --vae-patch-parallel-size 2: {encodes} split encodes, {decodes} split decodes")
    jobs = [
        [CAPTURE_FRAMES, folder / f"{name}-frames", "run", prompts, "--model", tiny_ckpt, "--out",
         folder / name, *flags, "--save-latents", "--no-progress"]
        for name, flags in CONFIGS.items()
    ]  # fmt: skip
    codes = torchrun_jobs(2, jobs, folder / "launch")
    forwards, texts = planned_forwards(requests, Checkpoint.open(tiny_ckpt).config("scheduler"))
    planned = CliRunner().invoke(app, ["plan", str(prompts), "--json"], catch_exceptions=False)
    chains = json.loads(planned.output)["transfer"]  # the chunks and VAE calls plan counts
    log = folder / "launch" / "stderr.txt"
    for name, code in zip(CONFIGS, codes, strict=True):
        assert code == 0, (name, log.read_text()[-3000:])
        out = folder / name
        for rid, (latents, frames) in reference.items():
            assert torch.equal(load_file(out / f"{rid}.latents.safetensors")["latents"], latents), (name, rid)
            if frames is not None:
                ours = np.load(folder / f"{name}-frames" / f"{rid}.npy")
                assert ours.size == frames.size, (name, rid)
                assert np.array_equal(ours, frames.reshape(ours.shape)), (name, rid)
            sidecar = json.loads((out / f"{rid}.json").read_text())
            assert sidecar["kind"] == ("t2v" if "t2v" in rid else "transfer"), (name, rid)
        made = [json.loads((out / f"{r.id}.json").read_text())["chunks"] for r in requests if r.transfer]
        assert chains == {
            "requests": len(made),
            "chunks": sum(m["chunks"] for m in made),
            "vae_decodes": sum(m["decodes"] for m in made),
            "vae_encodes": sum(m["encodes"] for m in made),
        }, (name, made)
        ranks = json.loads((out / "summary.json").read_text())["ranks"]
        assert len({r["collective_trace"] for r in ranks}) == 1, name  # lockstep
        assert len({r["world_trace"] for r in ranks}) == 1, name
        assert sum(r["ok"] for r in ranks) == len(ROWS), name
        sp = 2 if "--sp" in CONFIGS[name] else 1  # every rank of a group runs each of its forwards
        assert sum(r["gen_runs"] for r in ranks) == sp * forwards * LAYERS, name
        assert sum(r["und_runs"] for r in ranks) == sp * texts * LAYERS, name
        # plan's simulator: the same passes, UND passes, bytes and occupancy as the run (chains included).
        summary = json.loads((out / "summary.json").read_text())
        mode, max_active, gap = CONFIGS[name][1], int(CONFIGS[name][3]), int(CONFIGS[name][5])
        assert summary["config"]["prefill"] == {
            "free_share": 0.25,
            "max_wait": 2,
            "lookahead": 3,
            "chunk_gap": gap,
        }
        assert_simulated(summary, prompts, tiny_ckpt, mode, max_active, PrefillRule(chunk_gap=gap), sp)
        if sp == 2:  # the group split what the cut splits: every encode of a first chunk, every last decode
            assert [(r["vae_split_encodes"], r["vae_split_decodes"]) for r in ranks] == [
                split_counts(requests)
            ] * 2


def split_counts(requests) -> tuple[int, int]:
    """(encodes, decodes) the --vae-patch-parallel-size 2 group splits: each Transfer chunk's encodes of its
    controls and its target (the first at admission, the others at the chunk boundaries, on the decode team)
    and its decode, each other request's decode; split where the cut the workers plan (one thread) has two
    shards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encodes = decodes = 0
        for r in requests:
            split = len(plan_cut((r.height // 16, r.width // 16), 2, torch.device("cpu")).sizes) > 1
            chunks = 1 if r.transfer is None else r.transfer.num_chunks
            decodes += split * chunks
            encodes += split * (chunks * (len(r.transfer.controls) + 1) if r.transfer is not None else 0)
    finally:
        torch.set_num_threads(threads)
    return encodes, decodes
