"""model/fp8.py against its references: diffusers' own W8A16 linear and step policy, and (when installed)
nvidia-modelopt's per-tensor FP8 quantization, byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers.pipelines.cosmos.mixed_precision import Cosmos3MixedPrecisionConfig, _w8a16_linear

from cosmos3_batch.checkpoint.fp8_format import FP8, quantize_per_tensor
from cosmos3_batch.model.fp8 import Fp8Compute, make_compute, w8a16_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_is_diffusers_math_bit_for_bit(dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * 0.05
    q, _, scale = quantize_per_tensor(w)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    x = torch.randn(5, 7, 32, generator=g).to(dtype)
    layer = SimpleNamespace(weight=q, bias=b, weight_quantizer=SimpleNamespace(_scale=scale))
    expected = _w8a16_linear(layer, x, "probe")
    assert torch.equal(w8a16_linear(x, q, scale, b), expected)


def test_quantize_is_amax_over_448_and_saturates() -> None:
    w = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    q, amax, scale = quantize_per_tensor(w)
    assert q.dtype == FP8 and amax.dtype == torch.float32 and scale.shape == ()
    assert quantize_per_tensor(w.bfloat16())[2].dtype == torch.bfloat16  # as ModelOpt: the weight's dtype
    assert float(amax) == 2.0 and float(scale) == pytest.approx(2.0 / 448)
    assert float(q.float().abs().max()) == 448.0
    zeros, _, zscale = quantize_per_tensor(torch.zeros(3, 3))
    assert float(zscale) == 1.0 and not zeros.float().isnan().any()


@pytest.mark.parametrize(
    "first,last,overlap", [(3, 3, "a16"), (2, 1, "native"), (0, 0, "a16"), (5, 5, "a16")]
)
def test_step_policy_matches_diffusers(first: int, last: int, overlap: str) -> None:
    ref = Cosmos3MixedPrecisionConfig(format="fp8", first_steps=first, last_steps=last, overlap=overlap)
    ours = Fp8Compute(mode="checkpoint", first_steps=first, last_steps=last, overlap_a16=overlap == "a16")
    for steps in range(1, 12):
        for i in range(steps):
            assert ours.use_high_precision(i, steps) == ref.use_high_precision(i, steps), (i, steps)


def test_a16_and_a_device_without_fp8_gemm_always_run_w8a16() -> None:
    qc = {"quant_method": "modelopt", "quant_type": "FP8"}
    a16 = make_compute(qc, "a16", torch.device("cpu"))
    with pytest.warns(UserWarning, match="every step runs W8A16"):  # meta: a stand-in for a pre-Ada GPU
        checkpoint = make_compute(qc, "checkpoint", torch.device("meta"))
    on_cpu = make_compute(qc, "checkpoint", torch.device("cpu"))  # torch 2.13's CPU _scaled_mm: W8A8 runs
    assert on_cpu.w8a8_available and on_cpu.policy_name.startswith("checkpoint")
    for compute in (a16, checkpoint):
        for i in range(10):
            compute.select(i, 10, gen=True)
            assert compute.high_precision
        assert compute.policy_name == "w8a16"
    with pytest.raises(ValueError, match="--fp8-compute"):
        make_compute(qc, "w8a8", torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_equals_modelopt(dtype: torch.dtype) -> None:
    """The bytes nvidia-modelopt writes (FP8_DEFAULT_CFG, max calibration, then compress)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32)).to(dtype)
    source = [m.weight.detach().clone() for m in model]

    def calibrate(m: torch.nn.Module) -> None:
        m(torch.randn(4, 64, dtype=dtype))

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=calibrate)
    mtq.compress(model)
    state = model.state_dict()
    for i, w in enumerate(source):
        q, amax, scale = quantize_per_tensor(w)
        assert state[f"{i}.weight"].dtype == FP8
        assert torch.equal(state[f"{i}.weight"].view(torch.uint8), q.view(torch.uint8)), i
        assert torch.equal(state[f"{i}.weight_quantizer._amax"], amax), i
        assert torch.equal(state[f"{i}.weight_quantizer._scale"], scale), i


def test_checkpoint_policy_with_fp8_gemm_selects_per_step_and_stream() -> None:
    """What `checkpoint` would run where W8A8 exists (forced here: the selection logic, not the GEMM)."""
    compute = Fp8Compute(mode="checkpoint", first_steps=2, last_steps=1, w8a8_available=True)
    gen = [compute.select(i, 6, gen=True) or compute.high_precision for i in range(6)]
    assert gen == [True, True, False, False, False, True]
    compute.select(3, 6, gen=False)
    assert compute.high_precision  # the reasoner (UND) stream stays W8A16 by default
    assert not compute.base_high_precision  # proj_in & co: the native W8A8 path, as in the reference
    assert compute.policy_name.startswith("checkpoint")


def test_w8a8_math_and_dispatch_on_cpu() -> None:
    """torch 2.13 has a CPU `_scaled_mm`: the W8A8 math (run on CPU and on FP8-GEMM GPUs) is checked here
    against W8A16 (close, not equal: activations are e4m3 too), and Fp8Linear dispatches by the policy."""
    from cosmos3_batch.model.fp8 import Fp8Linear, w8a8_linear

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g) * 0.05
    q, _, scale = quantize_per_tensor(w)
    bias = torch.randn(64, generator=g)
    x = torch.randn(2, 5, 32, generator=g)
    a16, a8 = w8a16_linear(x, q, scale, bias), w8a8_linear(x, q, scale, bias)
    assert a8.shape == a16.shape == (2, 5, 64) and a8.dtype == torch.float32
    assert 0 < (a8 - a16).abs().max() <= 0.1 * a16.abs().max()
    compute = Fp8Compute(mode="checkpoint", first_steps=1, last_steps=1, w8a8_available=True)
    linear = Fp8Linear(32, 64, True, compute)
    linear.weight.data, linear.bias.data, linear.weight_quantizer._scale.data = q, bias, scale
    compute.select(0, 4, gen=True)
    assert torch.equal(linear(x), a16)
    compute.select(2, 4, gen=True)
    assert torch.equal(linear(x), a8)
    assert (compute.w8a16_calls, compute.w8a8_calls) == (1, 1)


def test_applier_gives_each_request_its_steps_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sharing a pass are at different steps; batched or not, each runs its own step's math and a
    batched group never mixes W8A16 and W8A8 requests (a group is one GEMM per projection)."""
    import cosmos3_batch.pipeline.passes.apply as apply
    from cosmos3_batch.model.cosmos3 import GEN

    compute = Fp8Compute(mode="checkpoint", first_steps=1, last_steps=1, w8a8_available=True)
    seen: list[tuple[list[int], bool]] = []
    split = SimpleNamespace(num_layers=2, fp8=compute)
    split.gen_layer = lambda layer, branch, index: seen.append(([branch.step], compute.high_precision))
    monkeypatch.setattr(
        apply,
        "gen_layer_batched",
        lambda s, layer, group, index: seen.append(([b.step for b in group], compute.high_precision)),
    )
    jobs = []
    for step in (0, 2, 4, 3):
        branches = [SimpleNamespace(step=step, gen_hidden=torch.zeros(4, 8), shard=None)]
        jobs.append(
            SimpleNamespace(
                step_index=step, timesteps=list(range(5)), error=None, branches=branches, cache=None,
                owns_parts=False,
                gen_branches=lambda branches=branches: branches,
            )
        )  # fmt: skip
    for batched in (False, True):
        seen.clear()
        apply.PartApplier(split, batched)(jobs, None, 0, GEN)
        assert sorted(s for steps, _ in seen for s in steps) == [0, 2, 3, 4]
        for steps, high in seen:
            assert {compute.use_high_precision(s, 5) for s in steps} == {high}, (batched, seen)


def test_shapes_no_fp8_gemm_takes_run_w8a16_and_e4m3_is_never_upcast() -> None:
    """_scaled_mm needs dims in multiples of 16: a linear of other shape runs W8A16 on a W8A8 step; and the
    float32 modules' rule (the time embedding) leaves e4m3 weights as stored."""
    from cosmos3_batch.model.dtypes import DtypeRule
    from cosmos3_batch.model.fp8 import Fp8Linear, w8a16_linear

    g = torch.Generator().manual_seed(2)
    compute = Fp8Compute(mode="checkpoint", first_steps=0, last_steps=0, w8a8_available=True)
    for width, w8a8 in ((40, False), (48, True)):
        q, _, scale = quantize_per_tensor(torch.randn(width, 32, generator=g) * 0.05)
        linear = Fp8Linear(32, width, False, compute)
        linear.weight.data, linear.weight_quantizer._scale.data = q, scale
        compute.select(2, 4, gen=True)
        x = torch.randn(3, 32, generator=g)
        before = (compute.w8a16_calls, compute.w8a8_calls)
        out = linear(x)
        assert (compute.w8a16_calls - before[0], compute.w8a8_calls - before[1]) == (int(not w8a8), int(w8a8))
        assert torch.equal(out, w8a16_linear(x, q, scale, None)) != w8a8
    rule = DtypeRule(torch.bfloat16, ("time_embedder",))
    assert rule("time_embedder.linear_1.weight", FP8) == FP8
    assert rule("time_embedder.linear_1.weight_quantizer._scale", torch.bfloat16) == torch.float32
    assert rule("layers.0.mlp.up_proj.weight", torch.float32) == torch.bfloat16
