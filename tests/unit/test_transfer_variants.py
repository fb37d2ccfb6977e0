"""Transfer (DESIGN.md §17) in the cases tests/unit/test_transfer.py leaves out, each bit-exact on CPU against
`Cosmos3OmniModularPipeline` (every chunk's latents, torch.equal; the frames, np.array_equal) run from the
same folder in the same dtype:

- three controls at once, given in another order than the canonical one, text and control guidance both on;
- a checkpoint stored in bfloat16, run as stored, a 2-chunk chain included;
- `--dtype` (`load_context(dtype=...)`): a float32 checkpoint cast to bfloat16 and a bf16 one upcast;
- FP8 (`convert --fp8`, W8A16 compute) against the modular pipeline with diffusers' own W8A16 linears, and
  W8A8 (which no reference computes): a chain's bits whatever shares its passes;
- `--batch-branches` forced on, with branches of different lengths (cond over [controls, target], cond over
  [target] alone, uncond), all of at least 16 rows: the floor docs/numerics.md guarantees on every x86-64;
- Transfer requests next to I2V and T2V ones at --max-active 3 (the plain ones against
  `Cosmos3OmniPipeline`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import imageio
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
from safetensors.torch import load_file

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.model.numerics import mkl_cnr_mode
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.kinds.denoise import Result
from cosmos3_batch.pipeline.passes import apply
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.plan.branches import COND, COND_NO_CONTROL, UNCOND, transfer_plan
from cosmos3_batch.requests.parse import Request, load_requests
from tests.conftest import moving_square, write_jsonl
from tests.fp8_reference import patch_w8a16
from tests.reference import reference_kwargs, transfer_outputs, transfer_reference

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

# 96x64: 3 x 2 tokens per latent frame (the tiny VAE's 16x and the 2x2 patch), so a 9-frame chunk's target
# alone is 18 rows: the >= 16 rows test_batch_branches_forced_on needs of every branch.
BASE = {"size": "96x64", "num_inference_steps": 2}
# Given depth, edge, blur: the model sees edge, blur, depth (requests/transfer.py HINTS), as the reference.
THREE = {"id": "three", "prompt": "a wet road at dusk", "negative_prompt": "blurry",
         "control": {"depth": "depth.mp4", "edge": "edge.mp4", "blur": "blur.mp4"},
         "guidance_scale": 3.0, "control_guidance": 2.0, "seed": 1}  # fmt: skip
# 17 frames in chunks of 9 overlapping by 1: 2 chunks, both axes on.
CHAIN = {"id": "chain", "prompt": "night", "control": {"edge": "long.mp4"}, "num_frames": 17,
         "frames_per_chunk": 9, "guidance_scale": 2.0, "control_guidance": 1.5, "seed": 5}  # fmt: skip
I2V = {"id": "i2v", "prompt": "the scene moves", "image": "IMAGE", "num_frames": 9, "seed": 3}
T2V = {"id": "t2v", "prompt": "a cat walks", "negative_prompt": "blurry", "num_frames": 9, "seed": 7}
Outputs = dict[str, tuple[torch.Tensor, np.ndarray | None]]


@pytest.fixture(scope="module")
def requests_(tmp_path_factory, cond_image: Path) -> dict[str, Request]:
    folder = tmp_path_factory.mktemp("transfer-variants")
    rng = np.random.RandomState(0)
    moving = moving_square(17, 64, 96, step=4)
    imageio.mimwrite(folder / "long.mp4", moving, fps=8)
    imageio.mimwrite(folder / "edge.mp4", moving[:9], fps=8)
    # Not the output size on purpose: the reference's preprocessing resizes it, and so must ours.
    imageio.mimwrite(folder / "blur.mp4", [(rng.rand(80, 112, 3) * 255).astype(np.uint8)] * 9, fps=8)
    y, x = np.mgrid[0:64, 0:96]
    depth = [np.repeat(((x * 5 + y * 3 + 7 * i) % 256).astype(np.uint8)[..., None], 3, 2) for i in range(9)]
    imageio.mimwrite(folder / "depth.mp4", depth, fps=8)
    rows = [{**BASE, **row} for row in (THREE, CHAIN, {**I2V, "image": str(cond_image)}, T2V)]
    requests, errors = load_requests(str(write_jsonl(folder / "t.jsonl", rows)))
    assert errors == []
    return {r.id: r for r in requests}


def line_order(r: Request) -> Request:
    """The request with its controls in the order its line gave them: the reference orders them itself."""
    given = {hint: i for i, hint in enumerate(THREE["control"])} if r.id == "three" else {}
    controls = tuple(sorted(r.transfer.controls, key=lambda pair: given.get(pair[0], 0)))
    return dataclasses.replace(r, transfer=dataclasses.replace(r.transfer, controls=controls))


def reference_outputs(pipe, requests: list[Request]) -> Outputs:
    """`transfer_outputs` (tests/reference.py) with each line's controls in the line's order."""
    return transfer_outputs(pipe, [line_order(r) for r in requests])


def run(
    ckpt: Path, requests: list[Request], max_active: int, batch_branches: bool | None = None, **load: str
) -> tuple[dict[str, Result], PassRunner]:
    """Our pass loop on `ckpt` (`load`: load_context's --dtype / --fp8-compute), resident weights."""
    ctx = load_context(ckpt, torch.device("cpu"), **load)
    results, errors = {}, {}

    def on_finished(job, result, error) -> None:
        (results if error is None else errors)[job.request.id] = result if error is None else error

    runner = PassRunner(
        ctx, ResidentWeights(ctx.layers), max_active, on_finished, batch_branches=batch_branches
    )
    runner.run(requests)
    assert errors == {}
    return results, runner


def assert_equal(ours: dict[str, Result], expected: Outputs) -> None:
    assert sorted(ours) == sorted(expected)
    for rid, (latents, frames) in expected.items():
        assert ours[rid].latents.dtype == torch.float32, rid
        assert torch.equal(ours[rid].latents, latents.float()), rid
        if frames is not None:
            assert frames.size == ours[rid].frames.size, rid
            assert np.array_equal(ours[rid].frames, frames.reshape(ours[rid].frames.shape)), rid


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path, requests_: dict[str, Request]) -> Outputs:
    """float32: the modular pipeline for Transfer, `Cosmos3OmniPipeline` for I2V and T2V (DESIGN.md §7)."""
    out = reference_outputs(transfer_reference(tiny_ckpt), [requests_["three"], requests_["chain"]])
    plain = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    plain.set_progress_bar_config(disable=True)
    base = dict(plain.scheduler.config)
    for rid in ("i2v", "t2v"):
        r = requests_[rid]
        results = []
        for output_type in ("latent", "np"):
            plain.scheduler = UniPCMultistepScheduler.from_config(base)
            generator = torch.Generator("cpu").manual_seed(r.seed)
            results.append(plain(**reference_kwargs(r), generator=generator, output_type=output_type).video)
        out[rid] = (results[0], np.asarray(results[1]))
    return out


def only(outputs: Outputs, *ids: str) -> Outputs:
    return {rid: outputs[rid] for rid in ids}


def test_three_controls_in_any_order_with_both_guidances(tiny_ckpt, requests_, reference):
    """The line gives depth, edge, blur and so does the reference's `control_videos`; both order them edge,
    blur, depth (fed in the line's order, ours gives other bits: the order is what this checks)."""
    r = requests_["three"]
    assert r.transfer.hints == ("edge", "blur", "depth")
    # Both axes on at every step: 3 forwards, the full ones over 4 vision items (3 controls + target).
    scheduler = UniPCMultistepScheduler.from_config(Checkpoint.open(tiny_ckpt).config("scheduler"))
    scheduler.set_timesteps(r.num_inference_steps)
    s = r.transfer
    plan = transfer_plan(scheduler.timesteps.tolist(), r.guidance_scale, s.control_guidance,
                         s.guidance_interval, s.control_guidance_interval)  # fmt: skip
    assert {step.names for step in plan} == {(COND, COND_NO_CONTROL, UNCOND)}
    ours, _ = run(tiny_ckpt, [r], 1)
    assert_equal(ours, only(reference, "three"))


def test_transfer_mixed_with_i2v_and_t2v_at_max_active_3(tiny_ckpt, requests_, reference):
    """Two Transfer requests (one a 2-chunk chain, decoding and re-encoding between passes), an I2V and a T2V
    one in one run: each equals its own reference pipeline."""
    ours, runner = run(tiny_ckpt, list(requests_.values()), 3)
    assert_equal(ours, reference)
    # They really shared passes: three requests rode one pass, so a Transfer one among them (two are not).
    assert max(record.active for record in runner.timeline) == 3


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    """The tiny model stored in bfloat16 (its VAE stays float32, as make-tiny writes it)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-bf16") / "tiny-bf16", TinySpec(dtype="bfloat16"))


@pytest.fixture(scope="module")
def bf16_reference(bf16_ckpt: Path, requests_: dict[str, Request]) -> Outputs:
    """The modular pipeline on the bf16 folder as stored: `transformer` in bfloat16, the VAE as stored."""
    requests = [requests_["three"], requests_["chain"]]
    return reference_outputs(transfer_reference(bf16_ckpt, torch.bfloat16), requests)


def test_bf16_checkpoint_as_stored(bf16_ckpt, requests_, reference, bf16_reference):
    """No --dtype: the transformer computes in the stored bfloat16, the VAE in its stored float32."""
    ours, runner = run(bf16_ckpt, [requests_["three"], requests_["chain"]], 2)
    assert runner.ctx.split.dtype == torch.bfloat16 and runner.ctx.vae.dtype == torch.float32
    assert_equal(ours, bf16_reference)
    assert ours["chain"].latents.shape[0] == 2  # both chunks' latents compared
    # Guards the test: bf16 weights give other latents than the float32 model.
    assert not torch.equal(bf16_reference["three"][0].float(), reference["three"][0])


DTYPE_CASES = {
    "cast-bf16": ("float32", "bfloat16", "checkpoint"),
    "cast-bf16-vae-bf16": ("float32", "bfloat16", "bfloat16"),
    "upcast": ("bfloat16", "float32", "checkpoint"),
}


@pytest.mark.parametrize("case", DTYPE_CASES)
def test_dtype_override(tiny_ckpt, bf16_ckpt, requests_, reference, bf16_reference, case):
    """`--dtype` (and `--vae-dtype`) cast at load: equal to the modular pipeline with its transformer (and
    VAE) loaded by `from_pretrained(..., torch_dtype=...)` from the same folder, the VAE otherwise as stored,
    as tests/unit/test_dtypes.py builds the other modes' references. On the 2-chunk chain: the decode and
    re-encode between chunks run in the VAE's dtype, the controls are cast to the transformer's."""
    stored, dtype, vae_dtype = DTYPE_CASES[case]
    ckpt = tiny_ckpt if stored == "float32" else bf16_ckpt
    pipe = transfer_reference(ckpt, getattr(torch, dtype))
    if vae_dtype != "checkpoint":
        vae = AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", torch_dtype=getattr(torch, vae_dtype))
        pipe.update_components(vae=vae)
    expected = reference_outputs(pipe, [requests_["chain"]])
    ours, runner = run(ckpt, [requests_["chain"]], 1, dtype=dtype, vae_dtype=vae_dtype)
    assert (runner.ctx.split.dtype, runner.ctx.vae.dtype) == (getattr(torch, dtype), pipe.vae.dtype)
    assert_equal(ours, expected)
    # Guards the test: the cast changed the numbers (the stored dtype gives other latents).
    as_stored = reference if stored == "float32" else bf16_reference
    assert not torch.equal(expected["chain"][0].float(), as_stored["chain"][0].float())


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_ckpt: Path, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    convert_fp8(tiny_ckpt, dst, decoder_linear_weights)
    return dst


def test_fp8_w8a16(tiny_ckpt, fp8_ckpt, requests_, reference):
    """As tests/fp8_reference.py builds the FP8 reference: the pipeline loaded from the unquantized source,
    every linear the FP8 checkpoint stores in e4m3 given that checkpoint's weight and scale and diffusers'
    `_w8a16_linear` as its forward. The modular pipeline's mixed-precision schedule then resolves to
    "none" (the transformer is no ModelOpt backend), so every step is W8A16, as `--fp8-compute a16` is."""
    pipe = transfer_reference(tiny_ckpt)
    weights = load_file(fp8_ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    assert patch_w8a16(pipe.transformer, weights) > 0
    requests = [requests_["three"], requests_["chain"]]
    expected = reference_outputs(pipe, requests)
    ours, runner = run(fp8_ckpt, requests, 2, fp8_compute="a16")
    assert_equal(ours, expected)
    fp8 = runner.ctx.split.fp8
    assert fp8.w8a8_calls == 0 and fp8.w8a16_calls > 0
    # Guards the test: FP8 really changes the numbers.
    assert not torch.equal(expected["three"][0], reference["three"][0])


def test_fp8_w8a8_chain_does_not_depend_on_what_shares_its_passes(fp8_ckpt, requests_):
    """W8A8 (the checkpoint's policy at every step; no diffusers reference computes it) takes each sequence's
    own activation amax: a Transfer chain's branches of different lengths, alone or next to I2V and T2V
    requests, per branch or batched (>= 16 rows a branch), give the same bits (tests/unit/test_fp8_w8a8.py
    holds the same for the other modes)."""
    chain = requests_["chain"]
    others = [requests_["three"], requests_["i2v"], requests_["t2v"]]
    outputs = []
    for rows, max_active, batched in (
        ([chain], 1, False),
        ([chain, *others], 4, False),
        ([*others, chain], 4, True),
    ):
        ctx = load_context(fp8_ckpt, torch.device("cpu"), fp8_compute="checkpoint")
        fp8 = ctx.split.fp8
        assert fp8.w8a8_available  # torch 2.13 has the CPU kernel
        fp8.first_steps = fp8.last_steps = 0
        results, errors = {}, {}

        def done(job, result, error, results=results, errors=errors) -> None:
            (results if error is None else errors)[job.request.id] = result if error is None else error

        PassRunner(ctx, ResidentWeights(ctx.layers), max_active, done, batch_branches=batched).run(rows)
        assert errors == {} and fp8.w8a8_calls > 0
        outputs.append(results["chain"].latents)
    assert all(torch.equal(latents, outputs[0]) for latents in outputs[1:])


def test_batch_branches_forced_on(tiny_ckpt, requests_, reference, monkeypatch):
    """Strict CNR (docs/numerics.md) makes a float32 GEMM row computed in a call of >= 16 rows the same bits
    inside any larger call, on every x86-64 CPU; below 16 rows it is the CPU's business (why batching stays
    off by default on CPU). At 96x64 a 9-frame chunk is 3 latent frames x 6 tokens = 18 rows for the
    target alone, twice and four times that over [controls, target]; every text here is longer than 16
    tokens. So every branch has >= 16 rows, which this test checks, and batching is then exact wherever the
    project runs: no CPU's kernel thresholds are asserted (a one-frame Transfer, 6 rows, is left out)."""
    assert (mkl_cnr_mode() or "").endswith(",STRICT"), "the guarantee needs the project's MKL_CBWR policy"
    sizes: dict[str, list[list[int]]] = {"gen": [], "und": []}  # rows of each branch, per batched call
    for half in sizes:
        original = getattr(apply, f"{half}_layer_batched")

        def spy(split, layer, seqs, *rest, _original=original, _half=half):
            sizes[_half].append([getattr(s, f"{_half}_hidden").shape[0] for s in seqs])
            return _original(split, layer, seqs, *rest)

        monkeypatch.setattr(apply, f"{half}_layer_batched", spy)
    ours, _ = run(tiny_ckpt, list(requests_.values()), 3, batch_branches=True)
    assert_equal(ours, reference)
    rows = [n for groups in sizes.values() for group in groups for n in group]
    assert min(rows) >= 16, sizes
    # Batching really ran on Transfer's unequal branches: "three"'s cond over [3 controls, target] (4 x 18
    # rows) shared GEMMs with a branch over the target alone (18 rows).
    assert any({4 * 18, 18} <= set(group) for group in sizes["gen"]), sizes["gen"]
