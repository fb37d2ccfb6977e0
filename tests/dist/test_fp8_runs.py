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
from tests.dist.test_memory import probe
from tests.dist.test_runs import torchrun
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


@pytest.mark.parametrize("world,mode", [(2, "allgather"), (3, "local")])
def test_fp8_a16_bit_exact_under_torchrun(fp8_case, world, mode, tmp_path):
    fp8, prompts, expected = fp8_case
    out = tmp_path / "out"
    proc = torchrun(
        world,
        prompts,
        "--model",
        fp8,
        "--out",
        out,
        "--offload",
        mode,
        "--fp8-compute",
        "a16",
        "--save-latents",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rid, latents in expected.items():
        assert torch.equal(load_file(out / f"{rid}.latents.safetensors")["latents"], latents), rid


def _bytes_per_pass(summary: dict) -> float:
    ranks = summary["ranks"]
    moved = sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
    passes = {r["passes"] for r in ranks}
    assert len(passes) == 1, passes  # lockstep
    return moved / passes.pop()


def test_fp8_moves_at_most_0_6x_the_bf16_bytes(tmp_path):
    bf16 = write_tiny(tmp_path / "bf16", TinySpec(dtype="bfloat16"))
    fp8 = tmp_path / "fp8"
    convert_fp8(bf16, fp8, decoder_linear_weights)
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    per_pass = {}
    for name, ckpt in (("bf16", bf16), ("fp8", fp8)):
        out = tmp_path / f"out-{name}"
        proc = torchrun(2, prompts, "--model", ckpt, "--out", out, "--fp8-compute", "a16")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        per_pass[name] = _bytes_per_pass(summary)
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
