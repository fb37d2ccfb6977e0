"""`plan` sizing: hand-computed figures for a Nano-shaped config, and the engine's real slot size."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.cli import app
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.loading import transformer_rule
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.weights import build_weights
from cosmos3_batch.plan import job_plan, planner
from cosmos3_batch.plan.model_shape import model_shape
from cosmos3_batch.plan.shapes import NANO_TRANSFORMER, WAN22_VAE
from cosmos3_batch.requests.parse import parse_lines
from tests.conftest import write_jsonl

NANO = NANO_TRANSFORMER


@pytest.fixture
def nano_config_only(tmp_path, tiny_ckpt):
    """A checkpoint folder with Nano's transformer config and no weights: planning before a download."""
    root = tmp_path / "nano"
    shutil.copytree(tiny_ckpt, root, ignore=shutil.ignore_patterns("*.safetensors"))
    (root / "transformer" / "config.json").write_text(json.dumps(NANO))
    return Checkpoint.open(root)


def test_nano_figures_by_hand(nano_config_only):
    shape = model_shape(nano_config_only, world_size=8, fallback_dtype=torch.bfloat16)
    # One half-layer (UND or GEN): q 4096x4096, k and v 4096x1024, o 4096x4096, q/k norms 128 each,
    # MLP gate/up/down 3 x 4096x12288, two 4096 layernorms.
    params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    assert params == 192_946_432
    padded = -(-params * 2 // (8 * 256)) * (8 * 256)  # bf16 bytes, padded to world x ALIGN
    assert padded == 385_894_400
    assert [p.nbytes for p in shape.parts] == [padded] * 72
    assert shape.host_resident_bytes == 151936 * 4096 * 2  # embed_tokens, looked up on the host
    # proj_in, proj_out, time_embedder (two linears), the two final norms; lm_head is never read.
    device_params = (
        (192 * 4096 + 4096) + (4096 * 192 + 192) + (256 * 4096 + 4096 + 4096 * 4096 + 4096) + 2 * 4096
    )
    assert shape.device_resident_bytes == device_params * 2

    (request,), errors = parse_lines([b'{"id": "v", "prompt": "x", "size": "1280x720", "num_frames": 189}'])
    assert errors == []
    hw = planner.Hardware()
    est = planner.estimate(shape, [request], {"v": 300}, 8, 1, OffloadMode.ALLGATHER, 1, hw)
    shard = padded // 8
    assert est.slot_bytes == padded and est.layer_bytes == 72 * padded
    assert est.host_private_bytes_per_rank == 72 * shard + 151936 * 4096 * 2
    assert est.bytes_h2d_per_pass == 36 * shard
    assert est.bytes_gathered_per_pass == 36 * (padded - shard)
    gen = 48 * 23 * 40  # latent frames (188/4+1) x ceil(720/32) x 1280/32
    assert gen == 44_160
    kept = 2 * (36 * 300 * 1024 * 2 + gen * 4096) * 2  # two branches: UND K/V cache + GEN stream
    transient = (gen * 12288 * 3 + gen * (4096 + 2048) + (300 + gen) * 2048 + 2 * gen * 4096) * 2
    assert est.activation_bytes_per_rank == kept + transient
    # Three requests prefilled ahead hold their UND K/V (both branches) and nothing else.
    ahead = planner.estimate(shape, [request], {"v": 300}, 8, 1, OffloadMode.ALLGATHER, 1, hw, lookahead=3)
    assert ahead.activation_bytes_per_rank - est.activation_bytes_per_rank == 3 * 2 * 36 * 300 * 1024 * 2 * 2
    compute = (2 * params * 2 * gen + 2 * 4 * gen * (gen + 300) * 32 * 128) / 600e12
    fetch = shard / 50e9 + (padded - shard) / 350e9
    assert est.seconds_per_pass == pytest.approx(36 * max(compute, fetch), rel=1e-12)
    assert compute > fetch  # at 720p one request already hides the transfer on an H100 node
    assert est.outputs_per_hour == pytest.approx(8 * 3600 / (35 * est.seconds_per_pass))
    assert est.idle_share == 7 / 8  # one request on eight ranks, and the plan says so
    assert est.warnings == []  # fits; the idle share is the schedule's warning, shown with or without --model
    assert planner.idle_warning(est.idle_share).startswith("predicted idle share 88%:")


def test_warns_when_it_cannot_fit(nano_config_only):  # and says which flag to change
    shape = model_shape(nano_config_only, world_size=1, fallback_dtype=torch.bfloat16)
    (request,), _ = parse_lines([b'{"id": "v", "prompt": "x", "size": "1280x720", "num_frames": 189}'])
    small = planner.Hardware(device_gib=24)  # Nano's 28 GB of layers cannot sit on a 24 GB card
    est = planner.estimate(shape, [request], {"v": 300}, 1, 1, OffloadMode.RESIDENT, 1, small)
    assert any("--device-gib" in w and "--offload allgather" in w for w in est.warnings)


@pytest.mark.parametrize("dtype", ["checkpoint", "bfloat16"])  # --dtype bfloat16: half the float32 bytes
def test_slot_size_equals_the_engines(tiny_ckpt, dtype):
    ckpt = Checkpoint.open(tiny_ckpt)
    ctx = load_context(tiny_ckpt, torch.device("cpu"), with_layers=False, dtype=dtype)
    weights = build_weights(ctx.layers, ckpt, OffloadMode.ALLGATHER, World(), transformer_rule(ckpt, dtype))
    shape = model_shape(ckpt, world_size=1, fallback_dtype=torch.bfloat16, dtype=dtype)
    assert shape.act_bytes == (2 if dtype == "bfloat16" else 4)
    (request,), _ = parse_lines([b'{"id": "i", "prompt": "x", "num_frames": 1, "size": "32x32"}'])
    est = planner.estimate(shape, [request], {"i": 100}, 1, 1, OffloadMode.ALLGATHER, 1, planner.Hardware())
    assert [s.numel() for s in weights.engine.slots] == [
        est.slot_bytes
    ] * 3  # two GEN slots, one UND slot (equal halves)
    assert sum(s.numel() for s in weights.engine.slots) == est.slots_bytes
    assert (
        weights.engine.backend.source.host.arena.numel()
        == est.host_private_bytes_per_rank - shape.host_resident_bytes
    )
    weights.close()


def test_device_breakdown_of_nano_k4_720p_cfg_on_8_ranks_fits_an_h200(nano_config_only, tmp_path):
    root = nano_config_only.root
    (root / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
    row = {"prompt": "x", "size": "1280x720", "num_frames": 189}  # the model card's defaults: CFG 6.0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({**row, "id": f"v{i}"}) + "\n" for i in range(16)))
    h200 = planner.Hardware(device_gib=141)
    doc, text = job_plan.plan_job(str(prompts), str(root), 8, 1, "allgather", 4, h200)
    est = doc["estimate"]
    parts = est["device_breakdown"]
    assert list(parts) == [
        "slots", "layer_weights", "resident_weights", "activations", "batched_transient", "vae_decode",
        "runtime_overhead",
    ]  # fmt: skip
    assert all(isinstance(v, int) and v >= 0 for v in parts.values())
    assert sum(parts.values()) == est["device_bytes_per_rank"]
    assert est["device_bytes_per_rank"] < 141 * 2**30 and not doc.get("warnings") and not est["warnings"]
    assert parts["slots"] == est["slots_bytes"] == 3 * 385_894_400
    # One 1280x720x189 branch is 45 x 80 x 48 = 172,800 latent... patchified 2x2: 44,160 rows over the
    # 65,536-row budget with any other: a batched call holds one branch's transient, not all eight.
    (request,), _ = parse_lines([json.dumps(row).encode()])
    und = statistics.median(planner.prompt_tokens(nano_config_only, [request]).values())
    gen, kv = 44_160, 8 * 128
    one = (gen * 12288 * 3 + gen * (4096 + 2 * kv) + (und + gen) * 2 * kv + 2 * gen * 4096) * 2
    assert parts["batched_transient"] == one
    unbounded = job_plan.plan_job(str(prompts), str(root), 8, 1, "allgather", 4, h200, max_batch_rows=None)
    assert unbounded[0]["estimate"]["device_breakdown"]["batched_transient"] == 8 * one  # K=4 x 2 branches
    # The decode of a 189-frame 720p clip in float32 is the largest single item; tiled it is a fraction.
    assert parts["vae_decode"] > 16 * 2**30
    tiled = job_plan.plan_job(str(prompts), str(root), 8, 1, "allgather", 4, h200, vae_tiling=True)
    assert (
        tiled[0]["estimate"]["device_breakdown"]["vae_decode"] < parts["vae_decode"] / 3
    )  # + the output, twice
    for name in parts:  # the text shows the same lines
        assert f"  {name} " in text


def test_gpu_presets_and_flags_over_them(nano_config_only, tmp_path):
    from cosmos3_batch.plan.hardware import preset
    from tests.unit.test_cli import invoke

    h200, b300 = preset("h200"), preset("b300")
    assert (h200.device_gib, b300.device_gib) == (141, 288)
    assert b300.tflops == pytest.approx(0.6 * 2250) and b300.h2d_gbps == pytest.approx(0.8 * 128)
    with pytest.raises(ValueError, match="--gpu must be one of h100, h200, b200, b300"):
        preset("a100")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "v", "prompt": "x", "size": "1280x720", "num_frames": 189}\n')
    plan = ["plan", prompts, "--model", nano_config_only.root, "--offload", "resident", "--json"]
    fits = json.loads(invoke(*plan, "--gpu", "h200").output)["estimate"]
    assert fits["warnings"] == []  # Nano resident on one H200
    small = json.loads(invoke(*plan, "--gpu", "h200", "--device-gib", "24").output)["estimate"]
    assert any("--device-gib 24" in w for w in small["warnings"])  # the flag wins over the preset
    faster = json.loads(invoke(*plan, "--gpu", "b300").output)["estimate"]
    assert faster["seconds_per_pass"] < fits["seconds_per_pass"]
    bad = invoke("plan", prompts, "--gpu", "a100")
    assert bad.exit_code == 2 and "--gpu must be one of" in bad.output


def test_plan_sizes_distilled_and_edge_checkpoints(tmp_path, tiny_ckpt, tiny_distilled_ckpt, tiny_edge_ckpt):
    """Super as a base and as a 4-step distilled checkpoint, Edge's relu2 backbone (plan/shapes.py): the
    simulator runs 4 passes of one branch per distilled request where the base runs 50 of two, and an
    Edge half-layer has no gate projection."""
    from cosmos3_batch.plan.shapes import EDGE_TRANSFORMER, SUPER_TRANSFORMER

    def folder(source: Path, name: str, config: dict) -> Path:
        root = tmp_path / name
        shutil.copytree(source, root, ignore=shutil.ignore_patterns("*.safetensors"))
        (root / "transformer" / "config.json").write_text(json.dumps(config))
        (root / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
        return root

    rows = [{"id": f"r{i}", "prompt": "x", "size": "1024x1024", "num_frames": 1} for i in range(8)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    plans = {}
    for name, source in (("super", tiny_ckpt), ("super-4step", tiny_distilled_ckpt)):
        model = folder(source, name, SUPER_TRANSFORMER)
        result = CliRunner().invoke(app, ["plan", str(prompts), "--model", str(model), "--nproc", "2",
                                          "--max-active", "4", "--json"])  # fmt: skip
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(result.output)["simulation"]
    assert (plans["super"]["passes"], plans["super"]["und_sequence_runs"]) == (50, 16)
    assert (plans["super-4step"]["passes"], plans["super-4step"]["und_sequence_runs"]) == (4, 8)
    edge = Checkpoint.open(folder(tiny_edge_ckpt, "edge", EDGE_TRANSFORMER))
    shape = model_shape(edge, world_size=8, fallback_dtype=torch.bfloat16)
    # q 3072x3072, k and v 3072x1024, o 3072x3072, up and down 3072x9216 (no gate), two Nemotron norms, the
    # UND k-norm for GEN on the GEN half only.
    half = 2 * 3072 * 3072 + 2 * 3072 * 1024 + 2 * 3072 * 9216
    assert min(p.nbytes for p in shape.parts) >= half * 2
    assert max(p.nbytes for p in shape.parts) < (half + 4 * 3072 + 4 * 128) * 2 + 8 * 256


def test_a_config_that_names_more_layers_than_the_files_hold_is_exit_2(tmp_path, tiny_ckpt):
    """plan reads the files' headers where there are files: a config of 36 layers over a 2-layer file is a
    clear error naming the first tensor missing, not a traceback."""
    from tests.unit.test_cli import invoke

    root = tmp_path / "mixed"
    shutil.copytree(tiny_ckpt, root)
    (root / "transformer" / "config.json").write_text(json.dumps(NANO))
    row = {"id": "a", "prompt": "x", "size": "64x64", "num_frames": 1}
    result = invoke("plan", write_jsonl(tmp_path / "p.jsonl", [row]), "--model", root)
    assert result.exit_code == 2, result.output
    assert "is missing from the checkpoint" in result.output and "Traceback" not in result.output
