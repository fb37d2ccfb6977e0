"""`--sp S` in real `torchrun` jobs with gloo on CPU: bit-exact against `Cosmos3OmniPipeline.__call__` in
every offload mode, collectives identical within each group and the world-wide ones identical on every
rank, the pass count the simulator predicted, and a killed rank ending the job. `--vae-patch-parallel-size`
rides the same launches: decoded frames (float), latents (the I2V / V2V encode feeds them) and files equal
a run without it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.model.vae_shards import plan_cut
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl, x264_settings
from tests.dist.jobs import CAPTURE_FRAMES, run_here, torchrun_jobs
from tests.dist.test_runs import kill_rank_1_midrun
from tests.reference import reference_kwargs

pytestmark = pytest.mark.dist

# GEN rows (latent frames x H/32 x W/32) and their shards at --sp 2 / --sp 4: long 3x4x8 = 96 rows (48+48 /
# 24x4); odd 3x1x11 = 33 (17+16 / 17+16+0+0: uneven); mid 2x3x4 = 24 and sq 16 (fewer rows than two minimum
# shards: one rank holds them); img 1 (zero rows on every rank but the first). Images and videos, CFG on and
# off, 1-3 steps, a flow_shift override.
ROWS = [
    {"id": "long", "prompt": "a cat", "size": "256x128", "num_frames": 9, "num_inference_steps": 3,
     "guidance_scale": 6.0},
    {"id": "odd", "prompt": "a train passing", "size": "352x32", "num_frames": 9, "num_inference_steps": 2,
     "guidance_scale": 1.0},
    {"id": "img", "prompt": "snow", "size": "32x32", "num_frames": 1, "num_inference_steps": 2,
     "guidance_scale": 1.0},
    {"id": "mid", "prompt": "ocean waves", "size": "128x96", "num_frames": 5, "num_inference_steps": 2,
     "guidance_scale": 4.0, "flow_shift": 2.0},
    {"id": "sq", "prompt": "a street", "size": "128x128", "num_frames": 1, "num_inference_steps": 1,
     "guidance_scale": 6.0},
]  # fmt: skip


# --vae-patch-parallel-size: latents (H/16 x W/16) cut along the longer side, at P = 2 / P = 4: an image
# 8x8 (4+4 / 2x4 rows), an odd height 13x7 (7+6 / 4+3+3+3), a video cut along its width 8x16 (8+8 / 4x4), an
# I2V 8x8 (its conditioning encode split too), a V2V 4x8 (4+4 / the same two shards: two members idle) and
# an image too small to split (the writer decodes it alone).
ROOT = Path(__file__).resolve().parents[2]
VAE_ROWS = [
    {"id": "vimg", "prompt": "snow", "size": "128x128", "num_frames": 1, "num_inference_steps": 1},
    {"id": "vodd", "prompt": "a train", "size": "112x208", "num_frames": 5, "num_inference_steps": 1,
     "guidance_scale": 1.0},
    {"id": "vvid", "prompt": "a cat", "size": "256x128", "num_frames": 9, "num_inference_steps": 2,
     "guidance_scale": 4.0},
    {"id": "vi2v", "prompt": "swirl", "image": "first_frame.png", "size": "128x128", "num_frames": 5,
     "num_inference_steps": 1, "guidance_scale": 1.0},
    {"id": "vv2v", "prompt": "drift", "video": "clip.mp4", "size": "128x64", "num_frames": 9,
     "num_inference_steps": 1, "guidance_scale": 1.0},
    {"id": "vsmall", "prompt": "dot", "size": "32x32", "num_frames": 1, "num_inference_steps": 1},
]  # fmt: skip
VAE_CONFIGS = {2: [(2, 2)], 4: [(2, 2), (4, 4)]}  # (sp, P) by launch


def stderr_tail(err: str) -> str:
    """What a failed run said: from a fatal signal's thread dump if there is one (its module list alone
    would fill a plain tail), else the end."""
    fatal = err.find("Fatal Python error")
    return err[fatal : fatal + 4000] if fatal >= 0 else err[-4000:]


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """8 query heads, 2 KV heads: --sp 2 divides both, --sp 4 repeats each KV head over 2 ranks."""
    return write_tiny(tmp_path_factory.mktemp("ckpt8") / "tiny8", TinySpec(heads=8, kv_heads=2))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("sp") / "mix.jsonl", ROWS)


@pytest.fixture(scope="module")
def reference(tiny8, prompts):
    """Latents of `Cosmos3OmniPipeline.__call__` per request, at torchrun's one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = Cosmos3OmniPipeline.from_pretrained(tiny8)
        pipe.set_progress_bar_config(disable=True)
        base = dict(pipe.scheduler.config)
        out = {}
        for r in load_requests(str(prompts))[0]:
            overrides = {} if r.flow_shift is None else {"flow_shift": r.flow_shift}
            pipe.scheduler = UniPCMultistepScheduler.from_config(base, **overrides)
            generator = torch.Generator("cpu").manual_seed(r.seed)
            out[r.id] = pipe(**reference_kwargs(r), generator=generator, output_type="latent").video
        return out
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vae_prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    for name in ("first_frame.png", "clip.mp4"):
        shutil.copy(ROOT / "examples" / name, folder / name)
    return write_jsonl(folder / "vae.jsonl", VAE_ROWS)


@pytest.fixture(scope="module")
def vae_reference(tiny8, vae_prompts, tmp_path_factory):
    """The same requests without the flag, in this process: latents, float frames and files."""
    out = tmp_path_factory.mktemp("vae-ref")
    args = [CAPTURE_FRAMES, out / "frames", "run", vae_prompts, "--model", tiny8, "--out", out]
    assert run_here([*args, "--save-latents", "--no-progress"]) == 0
    return out


def vae_job(vae_prompts, tiny8, out: Path, sp: int, parts: int) -> list:
    args = [CAPTURE_FRAMES, out / "frames", "run", vae_prompts, "--model", tiny8, "--out", out, "--sp", sp]
    return [*args, "--vae-patch-parallel-size", parts, "--save-latents", "--no-progress"]


def split_counts(parts: int) -> tuple[int, int]:
    """Requests whose decode / whose conditioning encode the cut gives more than one shard: the cut the
    workers plan on this CPU (one thread, as under torchrun: the measured GEMM step decides, and where none
    is measured nothing is split)."""
    decodes = encodes = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for row in VAE_ROWS:
            w, h = (int(v) // 16 for v in row["size"].split("x"))
            split = len(plan_cut((h, w), parts, torch.device("cpu")).sizes) > 1
            decodes += split
            encodes += split and ("image" in row or "video" in row)
    finally:
        torch.set_num_threads(threads)
    return decodes, encodes


def check_vae_run(reference: Path, out: Path, world: int, sp: int, parts: int) -> None:
    for row in VAE_ROWS:
        rid = row["id"]
        latents = load_file(out / f"{rid}.latents.safetensors")["latents"]
        assert torch.equal(latents, load_file(reference / f"{rid}.latents.safetensors")["latents"]), rid
        frames = np.load(out / "frames" / f"{rid}.npy")
        assert frames.dtype == np.float32 and np.array_equal(
            frames, np.load(reference / "frames" / f"{rid}.npy")
        )
        name = f"{rid}.png" if row["num_frames"] == 1 else f"{rid}.mp4"
        got, want = (out / name).read_bytes(), (reference / name).read_bytes()
        assert got == want, bytes_mismatch(out / name, reference / name)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == len(VAE_ROWS) and summary["config"]["vae_patch_parallel_size"] == parts
    ranks = summary["ranks"]
    groups = [ranks[g * sp : (g + 1) * sp] for g in range(world // sp)]
    decodes, encodes = split_counts(parts)
    for members in groups:
        # The first P ranks decode together (a cut of fewer shards leaves the last idle); the others of the
        # group take no part.
        counts = [r["vae_split_decodes"] for r in members]
        assert counts[0] == counts[1] and all(c <= counts[0] for c in counts[:parts])
        assert all(c == 0 for c in counts[parts:])
        # Every rank of the group calls each encode (it needs the result): equal counts.
        assert len({r["vae_split_encodes"] for r in members}) == 1
        assert len({r["collective_trace"] for r in members}) == 1
    assert sum(members[0]["vae_split_decodes"] for members in groups) == decodes
    assert sum(members[0]["vae_split_encodes"] for members in groups) == encodes
    assert all(r["vae_messages"] > 0 for members in groups for r in members[:2])


def bytes_mismatch(got: Path, want: Path) -> str:
    """Equal frames, different files: each file's size, the first byte that differs, how x264 was set up."""
    a, b = got.read_bytes(), want.read_bytes()
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    encoders = f"x264: {x264_settings(got)!r} vs {x264_settings(want)!r}"
    return f"{got.name}: {len(a)} vs {len(b)} bytes, first difference at {first}; {encoders}"


def plan_passes(prompts, ckpt, world: int, sp: int, mode: str) -> dict:
    args = ["plan", str(prompts), "--model", str(ckpt), "--nproc", str(world), "--sp", str(sp)]
    result = CliRunner().invoke(app, [*args, "--offload", mode, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["simulation"]


# (world, sp, mode) by launch: each world size runs its configurations in one torchrun (tests/dist/jobs.py).
CONFIGS = {
    2: [(2, "allgather"), (2, "local"), (2, "resident"), (2, "sharded")],
    4: [(2, "allgather"), (4, "allgather"), (2, "local"), (4, "local")],
}


def check_sp_run(prompts, tiny8, reference, out, world: int, sp: int, mode: str) -> None:
    for rid, expected in reference.items():
        assert torch.equal(load_file(out / f"{rid}.latents.safetensors")["latents"], expected), rid
    summary = json.loads((out / "summary.json").read_text())
    ranks = summary["ranks"]
    assert summary["generated_ok"] == len(ROWS) and summary["config"]["sp"] == sp
    # World-wide: the same all-reduces and part fetches on every rank.
    for key in ("passes", "und_passes", "all_reduces", "gathers", "fetches", "world_trace"):
        assert len({r[key] for r in ranks}) == 1, (key, [r[key] for r in ranks])
    groups = [ranks[g * sp : (g + 1) * sp] for g in range(world // sp)]
    for g, members in enumerate(groups):
        assert [r["sp_group"] for r in members] == [g] * sp
        # Within a group: every collective, all-to-alls included, in the same order.
        assert len({r["collective_trace"] for r in members}) == 1
        assert len({r["all_to_alls"] for r in members}) == 1
        assert all(r["ok"] == 0 for r in members[1:])  # the first rank alone writes and reports
    assert sum(members[0]["all_to_alls"] for members in groups) > 0
    # Rows of metrics.csv: one per request, however many ranks ran it.
    lines = (out / "metrics.csv").read_text().splitlines()[1:]
    assert sorted(line.split(",")[0] for line in lines) == sorted(r["id"] for r in ROWS)
    sim = plan_passes(prompts, tiny8, world, sp, mode)
    assert (sim["passes"], sim["und_passes"]) == (ranks[0]["passes"], ranks[0]["und_passes"])


def batched_branches_and_a_failed_write(tiny8, reference, folder):
    """The GPU default (rows of a rank's branches joined per GEMM) through Ulysses. Not bit-exact on CPU by
    design (model/batched.py: a row rounds differently inside a bigger GEMM), so: close, and in lockstep.
    In the same run the leader's write of one more request fails: reported once, and the group goes on."""
    failing = {"id": "w1", "prompt": "x", "size": "128x128", "num_frames": 1, "num_inference_steps": 2}
    prompts = write_jsonl(folder / "p.jsonl", [*ROWS, failing])
    out = folder / "out"
    (out / "w1.png").mkdir(parents=True)  # the leader's write fails: a directory is in the way
    args = ["run", prompts, "--model", tiny8, "--out", out, "--sp", 2, "--batch-branches", "--save-latents"]

    def check(code: int) -> None:
        assert code == 1
        for rid, expected in reference.items():
            got = load_file(out / f"{rid}.latents.safetensors")["latents"]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=rid)
        summary = json.loads((out / "summary.json").read_text())
        assert [f["id"] for f in summary["failed"]] == ["w1"] and summary["generated_ok"] == len(ROWS)
        ranks = summary["ranks"]
        assert len({r["collective_trace"] for r in ranks}) == 1 and ranks[0]["all_to_alls"] > 0
        statuses = sorted(line.split(",")[:2] for line in (out / "metrics.csv").read_text().splitlines()[1:])
        assert statuses == sorted([[r["id"], "ok"] for r in ROWS] + [["w1", "failed"]])

    return [*args, "--no-progress"], check


# Under the exact marker, in the main tier only: scripts/test.sh's rerun under a lower instruction set takes
# tests/unit, where the facts these shards rest on are asserted in process (test_sequence_parallel).
@pytest.mark.exact
@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_sp_is_bit_exact_and_in_lockstep(
    tiny8, prompts, reference, vae_prompts, vae_reference, tmp_path, world
):
    """Every (sp, offload) of this world size in one launch; at world 2, batched branches and a failed
    write under --sp too; then --vae-patch-parallel-size."""
    jobs = []
    for sp, mode in CONFIGS[world]:
        out = tmp_path / f"sp{sp}-{mode}"
        jobs.append(["run", prompts, "--model", tiny8, "--out", out, "--sp", sp, "--offload", mode])
        jobs[-1] += ["--save-latents", "--no-progress"]
    checks = []
    if world == 2:
        (tmp_path / "batched").mkdir()
        args, check = batched_branches_and_a_failed_write(tiny8, reference, tmp_path / "batched")
        jobs.append(args)
        checks.append(check)
    vae = [(sp, parts, tmp_path / f"vae-sp{sp}-p{parts}") for sp, parts in VAE_CONFIGS[world]]
    codes = torchrun_jobs(
        world, jobs + [vae_job(vae_prompts, tiny8, out, sp, p) for sp, p, out in vae], tmp_path / "launch"
    )
    codes, vae_codes = codes[: len(jobs)], codes[len(jobs) :]
    stderr = tmp_path / "launch" / "stderr.txt"
    for (sp, mode), code in zip(CONFIGS[world], codes, strict=False):
        assert code == 0, (sp, mode, stderr_tail(stderr.read_text()))
        check_sp_run(prompts, tiny8, reference, tmp_path / f"sp{sp}-{mode}", world, sp, mode)
    for check, code in zip(checks, codes[len(CONFIGS[world]) :], strict=True):
        check(code)
    for (sp, parts, out), code in zip(vae, vae_codes, strict=True):
        assert code == 0, (sp, parts, stderr_tail(stderr.read_text()))
        check_vae_run(vae_reference, out, world, sp, parts)


def test_a_killed_rank_ends_an_sp_job(tiny8, tmp_path):
    rows = [
        {"id": f"k{i}", "prompt": "x", "size": "128x128", "num_frames": 5, "num_inference_steps": 30}
        for i in range(4)
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    # The group's second rank, mid-request: its leader waits on it in an all-to-all (or, its decodes shared
    # with --vae-patch-parallel-size, in a decode's halo exchange).
    args = [str(prompts), "--model", str(tiny8), "--sp", "2", "--vae-patch-parallel-size", "2"]
    survivor, seconds, stderr = kill_rank_1_midrun(args, tmp_path / "out")
    assert survivor.returncode == 69  # a peer stalled or died (DESIGN.md §6): requeue the job
    assert seconds < 90
    # One line naming the rank that left and where the job was (parallel/stall.py), no traceback.
    assert re.search(r"rank 1 (left the job|did not arrive within) ", stderr), stderr[-2000:]
    assert "Traceback" not in stderr
