"""FP8 under real torchrun (gloo, CPU): bit-exact with diffusers' W8A16 reference at world 2 (allgather)
and 3 (local), and about half the weight bytes per pass and host memory per rank of the bf16 source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.dist.jobs import torchrun_jobs
from tests.dist.test_memory import probe
from tests.fp8_reference import reference_latents
from tests.unit.test_fp8_fidelity import ROWS

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def fp8_case(tiny_ckpt: Path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8run")
    fp8 = folder / "tiny-fp8"
    convert_fp8(tiny_ckpt, fp8, decoder_linear_weights)
    prompts = write_jsonl(folder / "p.jsonl", ROWS)
    requests, errors = load_requests(str(prompts))
    assert errors == []
    return fp8, prompts, reference_latents(tiny_ckpt, fp8, requests)


def _bytes_per_pass(summary: dict) -> float:
    ranks = summary["ranks"]
    moved = sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
    passes = {r["passes"] for r in ranks}
    assert len(passes) == 1, passes  # lockstep
    return moved / passes.pop()


def fp8_job(ckpt: Path, prompts: Path, out: Path, mode: str, save_latents: bool = True) -> list:
    args = ["run", prompts, "--model", ckpt, "--out", out, "--offload", mode, "--fp8-compute", "a16"]
    return [*args, "--no-progress"] + (["--save-latents"] if save_latents else [])


def test_fp8_a16_bit_exact_at_world_3_local(fp8_case, tmp_path):
    fp8, prompts, expected = fp8_case
    codes = torchrun_jobs(3, [fp8_job(fp8, prompts, tmp_path / "out", "local")], tmp_path / "launch")
    assert codes == [0], (tmp_path / "launch" / "stderr.txt").read_text()[-3000:]
    for rid, latents in expected.items():
        assert torch.equal(load_file(tmp_path / "out" / f"{rid}.latents.safetensors")["latents"], latents), (
            rid
        )


def test_fp8_a16_bit_exact_at_world_2_and_moves_at_most_0_6x_the_bf16_bytes(fp8_case, tmp_path):
    """One launch of 2 ranks: the FP8 checkpoint bit-exact (allgather), then the bf16 source and its FP8
    conversion moving weight bytes per pass."""
    fp8_exact, exact_prompts, expected = fp8_case
    bf16 = write_tiny(tmp_path / "bf16", TinySpec(dtype="bfloat16"))
    fp8 = tmp_path / "fp8"
    convert_fp8(bf16, fp8, decoder_linear_weights)
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    jobs = [fp8_job(fp8_exact, exact_prompts, tmp_path / "out-exact", "allgather")]
    jobs += [
        fp8_job(ckpt, prompts, tmp_path / f"out-{name}", "allgather", False)
        for name, ckpt in (("bf16", bf16), ("fp8", fp8))
    ]
    codes = torchrun_jobs(2, jobs, tmp_path / "launch")
    assert codes == [0, 0, 0], (tmp_path / "launch" / "stderr.txt").read_text()[-3000:]
    for rid, latents in expected.items():
        got = load_file(tmp_path / "out-exact" / f"{rid}.latents.safetensors")["latents"]
        assert torch.equal(got, latents), rid
    per_pass = {
        name: _bytes_per_pass(json.loads((tmp_path / f"out-{name}" / "summary.json").read_text()))
        for name in ("bf16", "fp8")
    }
    assert per_pass["fp8"] <= 0.6 * per_pass["bf16"], per_pass
    print(
        f"weight bytes per pass, world 2 allgather: {per_pass} ratio {per_pass['fp8'] / per_pass['bf16']:.3f}"
    )


def test_fp8_rank_holds_at_most_0_6x_the_bf16_shard_privately(tmp_path):
    spec = TinySpec(layers=24, hidden=256, heads=4, kv_heads=2, intermediate=1024, dtype="bfloat16")
    bf16 = write_tiny(tmp_path / "bf16", spec)
    fp8 = tmp_path / "fp8"
    convert_fp8(bf16, fp8, decoder_linear_weights)
    held = {name: probe(ckpt, "allgather", tmp_path) for name, ckpt in (("bf16", bf16), ("fp8", fp8))}
    for b, f in zip(held["bf16"], held["fp8"], strict=True):
        assert f["rss_anon_delta"] <= 0.6 * b["rss_anon_delta"], (b, f)
        # No transient full model while loading: the peak stays at the rank's shard + slots + a little.
        shard = f["layer_bytes"] / 2
        assert f["rss_anon_peak_delta"] <= shard + f["slot_bytes"] + 4 * 2**20, f
    print("rss_anon_delta per rank:", {k: [r["rss_anon_delta"] for r in v] for k, v in held.items()})
    print(
        "rss_anon_peak_delta per rank:", {k: [r["rss_anon_peak_delta"] for r in v] for k, v in held.items()}
    )
