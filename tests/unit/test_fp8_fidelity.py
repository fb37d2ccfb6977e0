"""FP8 through our loader and pass loop equals diffusers' W8A16 reference bit for bit (float32, CPU), and
a damaged FP8 checkpoint stops `run` with exit 2 naming the file and tensor, before any weight is read."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.cli import app
from cosmos3_batch.model.fp8 import Fp8Linear
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.pipeline.job import load as job_load
from cosmos3_batch.pipeline.job import run as job
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON
from tests.fp8_reference import reference_latents

ROWS = [
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 3,
     "seed": 7},
    {"id": "t2v", "prompt": "a cat", "negative_prompt": "blur", "size": "48x32", "num_frames": 9,
     "num_inference_steps": 4, "seed": 1},
    {"id": "nocfg", "prompt": "waves", "size": "48x32", "num_frames": 5, "num_inference_steps": 2,
     "guidance_scale": 1.0, "flow_shift": 2.0, "seed": 2},
]  # fmt: skip


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_ckpt: Path, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    convert_fp8(tiny_ckpt, dst, decoder_linear_weights)
    return dst


@pytest.fixture(scope="module")
def requests_(tmp_path_factory):
    requests, errors = load_requests(str(write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", ROWS)))
    assert errors == []
    return requests


def test_a16_bit_exact_with_diffusers_w8a16(tiny_ckpt, fp8_ckpt, requests_):
    expected = reference_latents(tiny_ckpt, fp8_ckpt, requests_)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = load_context(fp8_ckpt, torch.device("cpu"), fp8_compute="a16")
        linears = [m for m in ctx.layers.modules() if isinstance(m, Fp8Linear)]
        assert len(linears) == 28 and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
        results = {}
        runner = PassRunner(
            ctx, ResidentWeights(ctx.layers), 2, lambda j, r, e: results.__setitem__(j, (r, e))
        )
        runner.run(requests_)
    finally:
        torch.set_num_threads(threads)
    for j, (result, error) in results.items():
        assert error is None, error
        assert torch.equal(result.latents, expected[j.request.id]), j.request.id
    assert ctx.split.fp8.w8a8_calls == 0 and ctx.split.fp8.w8a16_calls > 0
    # Guards the test: FP8 really changes the numbers (the unquantized model gives other latents).
    plain = reference_latents(tiny_ckpt, None, requests_[:1])
    assert not torch.equal(plain["t2i"], expected["t2i"])


def _scale_file(ckpt: Path) -> Path:
    return ckpt / "transformer" / "diffusion_pytorch_model.safetensors"


def truncate_at_scale(ckpt: Path) -> str:
    """Cut the file inside the last scale tensor's bytes."""
    from cosmos3_batch.checkpoint.reader import SafetensorsFile

    st = SafetensorsFile(_scale_file(ckpt))
    name, (_, _, start, _) = max(
        ((n, info) for n, info in st.tensors.items() if n.endswith("_scale")), key=lambda kv: kv[1][2]
    )
    with open(_scale_file(ckpt), "r+b") as f:
        f.truncate(start + 2)
    return name


def wrong_shape_scale(ckpt: Path) -> str:
    from safetensors.torch import save_file

    tensors = load_file(_scale_file(ckpt))
    name = "layers.1.mlp_moe_gen.up_proj.weight_quantizer._scale"
    tensors[name] = tensors[name].reshape(1).repeat(3)
    save_file(tensors, _scale_file(ckpt))
    return name


def unknown_method(ckpt: Path) -> str:
    path = ckpt / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    path.write_text(json.dumps(config))
    return "quant_method 'bitsandbytes'"


@pytest.mark.parametrize("damage", [truncate_at_scale, wrong_shape_scale, unknown_method])
def test_damaged_fp8_checkpoint_exits_2(damage, tiny_ckpt, tmp_path, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("got past planning with a checkpoint that should have been rejected")

    monkeypatch.setattr(job_load, "load_context", refuse)
    monkeypatch.setattr(job_load, "build_weights", refuse)
    ckpt = tmp_path / "fp8"
    convert_fp8(tiny_ckpt, ckpt, decoder_linear_weights)
    what = damage(ckpt)
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:1])
    result = CliRunner().invoke(
        app, ["run", str(prompts), "--model", str(ckpt), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    where = "config.json" if damage is unknown_method else "diffusion_pytorch_model.safetensors"
    assert f"{ckpt}/transformer/{where}" in result.output and what in result.output, result.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a16_through_the_engine_single_process(tiny_ckpt, fp8_ckpt, requests_, tmp_path):
    """The DLO engine with parts that hold two dtypes (e4m3 weights, float32 scales): still bit-exact."""
    expected = reference_latents(tiny_ckpt, fp8_ckpt, requests_)
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch", "run", str(prompts), "--model", str(fp8_ckpt)]
    cmd += ["--out", str(tmp_path / "o"), "--offload", "allgather", "--fp8-compute", "a16", "--save-latents"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    for rid, latents in expected.items():
        assert torch.equal(load_file(tmp_path / "o" / f"{rid}.latents.safetensors")["latents"], latents), rid
        sidecar = json.loads((tmp_path / "o" / f"{rid}.json").read_text())
        assert sidecar["weights"] == {"format": "fp8_e4m3", "fp8_compute": "w8a16", "fp8_mode": "a16"}
    (rank,) = json.loads((tmp_path / "o" / "summary.json").read_text())["ranks"]
    assert rank["weights"]["w8a8_calls"] == 0 and rank["weights"]["w8a16_calls"] > 0


def _modelopt_checkpoint(src: Path, dst: Path) -> Path:
    """The tiny model quantized by nvidia-modelopt itself (FP8_DEFAULT_CFG: proj_in too, with input
    amaxes), saved with the ModelOpt tensor names: a checkpoint we did not write."""
    import shutil

    from diffusers import Cosmos3OmniTransformer
    from safetensors.torch import save_file

    mtq = pytest.importorskip("modelopt.torch.quantization")
    shutil.copytree(src, dst)
    model = Cosmos3OmniTransformer.from_pretrained(dst / "transformer", torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)

    def calibrate(m: torch.nn.Module) -> None:
        for module in m.modules():
            if hasattr(module, "input_quantizer") and hasattr(module, "in_features"):
                module(torch.randn(4, module.in_features, generator=g))

    # As diffusers' ModelOpt quantizer does (use_keep_in_fp32_modules): the float32 modules stay unquantized.
    # (Quantized, the reference itself breaks: it casts timesteps to its first parameter's dtype, e4m3.)
    cfg = {**mtq.FP8_DEFAULT_CFG, "quant_cfg": [*mtq.FP8_DEFAULT_CFG["quant_cfg"]]}
    cfg["quant_cfg"].append({"quantizer_name": "*time_embedder*", "enable": False})
    mtq.compress(mtq.quantize(model, cfg, forward_loop=calibrate))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, _scale_file(dst))
    path = dst / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_type": "FP8"}
    path.write_text(json.dumps(config))
    return dst


def test_a16_on_a_checkpoint_modelopt_wrote(tiny_ckpt, requests_, tmp_path):
    ckpt = _modelopt_checkpoint(tiny_ckpt, tmp_path / "modelopt")
    requests = requests_[:2]
    expected = reference_latents(tiny_ckpt, ckpt, requests)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = load_context(ckpt, torch.device("cpu"), fp8_compute="a16")
        outside = [n for n, m in ctx.split.transformer.named_modules() if isinstance(m, Fp8Linear)]
        assert "proj_in" in outside and "layers.1.mlp_moe_gen.down_proj" in outside
        results = {}
        PassRunner(ctx, ResidentWeights(ctx.layers), 2, lambda j, r, e: results.__setitem__(j, (r, e))).run(
            requests
        )
    finally:
        torch.set_num_threads(threads)
    for j, (result, error) in results.items():
        assert error is None, error
        assert torch.equal(result.latents, expected[j.request.id]), j.request.id


def test_resume_tells_fp8_compute_policies_apart(fp8_ckpt, tiny_ckpt, tmp_path, monkeypatch):
    """A rerun skips outputs made with the same --fp8-compute and redoes those made with the other."""
    from cosmos3_batch.config import make_config

    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:1])
    out = tmp_path / "o"
    plans = {}
    for compute in ("a16", "checkpoint"):
        cfg = make_config("resident", None, prompts=prompts, out=out, model=fp8_ckpt, fp8_compute=compute)
        plans[compute] = job.plan_run(cfg)
    assert plans["a16"].model_identity != plans["checkpoint"].model_identity
    cfg = make_config("resident", None, prompts=prompts, out=out, model=tiny_ckpt, fp8_compute="a16")
    assert job.plan_run(cfg).model_identity == Checkpoint.open(tiny_ckpt).identity()  # unquantized: as before
