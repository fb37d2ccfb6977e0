"""FP8 weights in NVIDIA ModelOpt's per-tensor layout, and how a layer computes with them.

The checkpoint layout is the one ModelOpt's Hugging Face checkpointing writes and diffusers 0.42 restores
(measured with nvidia-modelopt 0.47.0 on a tiny Cosmos3, `mtq.quantize(FP8_DEFAULT_CFG)` + `mtq.compress`):
for every quantized `nn.Linear` named N,

    N.weight                   F8_E4M3, the linear's shape    round(w / scale) in e4m3 (saturated at 448)
    N.weight_quantizer._amax   shape (), the source's dtype   max |w| over the whole tensor
    N.weight_quantizer._scale  shape (), the source's dtype   amax / 448
    N.input_quantizer._amax    shape ()                       calibrated max |x| (used by W8A8 only)

and `transformer/config.json` carries `quantization_config` (`quant_method: "modelopt"`, `quant_type:
"FP8"`, and for the step policy `runtime.diffusion_step_policy`). W8A16, as diffusers'
`pipelines/cosmos/mixed_precision.py::_w8a16_linear` computes it: `F.linear(x, weight.to(x.dtype) *
scale.to(x.dtype), bias)`. We do the same ops in the same order, so outputs match bit for bit.

Restoring through diffusers, measured with diffusers 0.42.1 + nvidia-modelopt 0.47.0 + torch 2.13 (CPU): the
package installs and imports, `mtq.quantize` + `mtq.compress` work, but `from_pretrained` on the saved
folder fails three ways: `quantization_config` without `modelopt_config` -> TypeError "'list' object is not
a mapping" in `NVIDIAModelOptConfig.get_config_from_quant_type` (ModelOpt's quant_cfg became a list); with
no `quantization_config` -> accelerate's `set_module_tensor_to_device`: "QTensorWrapper.__new__() got an
unexpected keyword argument 'requires_grad'"; with a `modelopt_config` -> ModelOpt's quant_linear
`__setitem__` inside `create_quantized_param`: "self._dequantize is True and self.fake_quant is False".
With nvidia-modelopt 0.39.0 instead, diffusers' own `NVIDIAModelOptConfig(quant_type="FP8")` path runs and
restores, but on CPU it leaves float32 (fake-quant) weights with only `_amax`: not the serialized e4m3
format its mixed-precision code requires, so that reference cannot run either.

The step policy: diffusers' `_classify_cosmos3_linear` calls `self_attn.to_q/k/v/to_out` "generation" and
`add_q/k/v_proj/to_add_out` "reasoner", but the transformer applies `to_*` to the UND (text) stream and
`add_*` to GEN (see model/cosmos3.py). With every step W8A16 and the reasoner high-precision (what `a16`
and the fidelity tests use) the two agree; in W8A8 steps they would not, and we follow the streams.

Nothing here imports torch.distributed: a linear computes with whatever tensors the engine points it at.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cosmos3_batch.checkpoint.fp8_format import E4M3_MAX, FP8, SCALE, QuantizationError
from cosmos3_batch.checkpoint.reader import TensorStore

log = logging.getLogger(__name__)
INPUT_AMAX = "input_quantizer._amax"

COMPUTE_MODES = ("checkpoint", "a16")


def w8a16_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Dequantize to the activation dtype, then the ordinary linear: diffusers' `_w8a16_linear` op for op."""
    dense = weight.to(dtype=x.dtype) * scale.to(device=weight.device, dtype=x.dtype)
    return F.linear(x, dense, bias)


QUANT_CHUNK_ROWS = 4096  # activations quantized this many rows at a time: a bounded float32 transient


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    input_amax: torch.Tensor | None = None,
    segments: list[int] | None = None,
    shared: SharedAmax | None = None,
) -> torch.Tensor:
    """FP8 GEMM (`torch._scaled_mm`, CUDA sm89+ and torch's CPU kernel): activations quantized per tensor,
    weights as stored.

    The activation scale is the checkpoint's calibrated `input_amax` when it has one (NVIDIA's releases:
    static, so nothing about the batch matters and nothing is reduced), else the dynamic amax of each
    sequence's own rows: `segments` gives the row counts of the sequences a batched call joined, and each
    is quantized and multiplied with its own scale, so a request's output never depends on what shares its
    passes. `amax_reduce` (--sp): the max of those amaxes over the ranks holding the sequences' other rows,
    as without --sp (every rank of the group calls it, with 0 for a sequence it holds no rows of).
    `shared`: the amaxes of the last input, reused when q/k/v (or gate/up) quantize the same tensor, so
    --sp reduces once per input, not once per linear."""
    rows = x.reshape(-1, x.shape[-1])
    sizes = segments if segments is not None else [rows.shape[0]]
    if input_amax is not None:
        amaxes = input_amax.float().reshape(1).expand(len(sizes))
    else:
        amaxes = shared.get(x) if shared is not None else None
        if amaxes is None:
            amaxes = _segment_amax(rows, sizes)
            if amax_reduce is not None:
                amaxes = amax_reduce(amaxes)
            if shared is not None:
                shared.keep(x, amaxes)
    if rows.shape[0] == 0:  # an --sp rank holding none of a short branch's rows
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    x_scales = (amaxes / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    w_scale = scale.float().reshape(())
    outs = []
    for seq, x_scale in zip(rows.split(sizes), x_scales, strict=True):
        if seq.shape[0] == 0:
            outs.append(seq.new_empty((0, weight.shape[0])))
            continue
        # weight.t() of a row-major [out, in] weight is the column-major right operand _scaled_mm wants.
        outs.append(
            torch._scaled_mm(
                _quantized(seq, x_scale), weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if bias is not None:
        out = out + bias.to(x.dtype)  # added outside: _scaled_mm restricts the bias dtype per output dtype
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _segment_amax(rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """max |x| of each sequence's rows (0 for a sequence with none here), float32, one per sequence."""
    return torch.stack(
        [
            seq.abs().amax().float() if seq.shape[0] else torch.zeros((), device=rows.device)
            for seq in rows.split(sizes)
        ]
    )


def _quantized(rows: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """rows / scale in e4m3, computed in float32 a chunk of rows at a time (the same bytes as all at once,
    without a float32 copy of the whole activation: 2.2 GB for a 720p branch's down_proj input)."""
    out = torch.empty(rows.shape, dtype=FP8, device=rows.device)
    for start in range(0, rows.shape[0], QUANT_CHUNK_ROWS):
        chunk = rows[start : start + QUANT_CHUNK_ROWS]
        out[start : start + QUANT_CHUNK_ROWS] = (chunk.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return out


class SharedAmax:
    """The amaxes of the input the last W8A8 linear quantized: q/k/v (and gate/up) read one tensor."""

    def __init__(self) -> None:
        self._input: weakref.ref | None = None
        self._version = -1
        self._amaxes: torch.Tensor | None = None

    def get(self, x: torch.Tensor) -> torch.Tensor | None:
        same = self._input is not None and self._input() is x and x._version == self._version
        return self._amaxes if same else None

    def keep(self, x: torch.Tensor, amaxes: torch.Tensor) -> None:
        self._input, self._version, self._amaxes = weakref.ref(x), x._version, amaxes

    def clear(self) -> None:
        self._input, self._amaxes = None, None


def fp8_gemm_available(device: torch.device) -> bool:
    """`torch._scaled_mm` with e4m3: a CUDA device of compute capability 8.9 (Ada/Hopper) or newer, or the
    CPU where this torch has the kernel (2.13 does)."""
    if device.type == "cpu":
        return _cpu_scaled_mm()
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _cpu_scaled_mm() -> bool:
    one = torch.ones((16, 16)).to(FP8)
    try:
        torch._scaled_mm(one, one.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@dataclass
class Fp8Compute:
    """Which math the FP8 linears run for the sequence being computed now (shared by all of them).

    `a16`: W8A16 every step. `checkpoint`: the checkpoint's first/last-N policy (W8A16 on its first and
    last steps, W8A8 between; the UND/"reasoner" stream per its reasoner policy), as diffusers'
    `Cosmos3MixedPrecisionConfig` decides it. Without an FP8 GEMM (CPU, pre-Ada GPUs) W8A8 falls back to
    W8A16, with one warning."""

    mode: str = "a16"
    first_steps: int = 3
    last_steps: int = 3
    overlap_a16: bool = True
    reasoner_a16: bool = True
    w8a8_available: bool = False
    high_precision: bool = True  # what the next linear call runs
    # --sp: set for the GEN half of a request split over a group (W8A8's amax over the whole sequence)
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Rows per sequence of the batched call running now (model/batched.py); None: one sequence.
    segments: list[int] | None = None
    shared: SharedAmax = field(default_factory=lambda: SharedAmax())
    w8a8_calls: int = 0  # counted, so metrics can say which math ran
    w8a16_calls: int = 0

    def select(self, step_index: int, num_steps: int, gen: bool) -> None:
        """Called before each sequence's layer half: sequences of one pass may be at different steps."""
        self.high_precision = self.wants_high_precision(step_index, num_steps, gen)

    def wants_high_precision(self, step_index: int, num_steps: int, gen: bool) -> bool:
        """W8A16 for this sequence's GEN (`gen`) or UND half at this step? (Selects nothing.)"""
        if self.mode == "a16" or not self.w8a8_available:
            return True
        if not gen:
            return self.reasoner_a16
        return self.use_high_precision(step_index, num_steps)

    @property
    def base_high_precision(self) -> bool:
        """Linears outside the decoder layers (proj_in, time embedder) have no step policy in the
        reference (its mixed-precision wrapper skips them): they always run the checkpoint's native path."""
        return self.mode == "a16" or not self.w8a8_available

    def use_high_precision(self, step_index: int, num_steps: int) -> bool:
        # The same rule as diffusers' Cosmos3MixedPrecisionConfig.use_high_precision.
        if num_steps == 1:
            return False  # a 1-step request keeps the checkpoint's base (W8A8) path, as the reference does
        first = step_index < self.first_steps
        last = step_index >= num_steps - self.last_steps
        if first and last:
            return self.overlap_a16
        return first or last

    @property
    def policy_name(self) -> str:
        if self.mode == "a16" or not self.w8a8_available:
            return "w8a16"
        return f"checkpoint(first={self.first_steps},last={self.last_steps},else=w8a8)"


def make_compute(qc: dict, mode: str, device: torch.device) -> Fp8Compute:
    """The compute policy for `--fp8-compute MODE` on DEVICE; parses the checkpoint's step policy with
    diffusers' own parser (so a policy the reference rejects is rejected here too)."""
    if mode not in COMPUTE_MODES:
        raise ValueError(f"--fp8-compute must be one of {', '.join(COMPUTE_MODES)}, got {mode!r}")
    compute = Fp8Compute(mode=mode, w8a8_available=fp8_gemm_available(device))
    policy = (qc.get("runtime") or {}).get("diffusion_step_policy")
    if mode == "checkpoint" and policy is not None:
        from diffusers.pipelines.cosmos.mixed_precision import parse_diffusion_step_policy

        parsed = parse_diffusion_step_policy(policy, qc)
        compute.first_steps, compute.last_steps = parsed.first_steps, parsed.last_steps
        compute.overlap_a16 = parsed.overlap == "a16"
        compute.reasoner_a16 = parsed.reasoner_policy == "high_precision"
    if mode == "checkpoint" and not compute.w8a8_available:
        warnings.warn(
            f"--fp8-compute checkpoint: no FP8 GEMM on {device} (needs CUDA sm89+); every step runs W8A16",
            stacklevel=2,
        )
    return compute


class _ScaleHolder(torch.nn.Module):
    """Stands where ModelOpt's `weight_quantizer` is, so the scale's parameter name is the checkpoint's."""

    def __init__(self) -> None:
        super().__init__()
        self._scale = torch.nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)


class _AmaxHolder(torch.nn.Module):
    """Stands where ModelOpt's `input_quantizer` is, when the checkpoint holds its calibrated `_amax`."""

    def __init__(self) -> None:
        super().__init__()
        self._amax = torch.nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)


class Fp8Linear(torch.nn.Module):
    """An `nn.Linear` whose weight is e4m3 plus one float32 scale; the engine may re-point both."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, compute: Fp8Compute, in_layer: bool = True
    ):
        super().__init__()
        self.in_layer = in_layer  # decoder-layer linears follow the step policy; the others never do
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.bias = torch.nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_quantizer = _ScaleHolder()
        self.compute = compute
        # _scaled_mm needs both GEMM dims in multiples of 16 (cuBLASLt's FP8 rule): other shapes (a small
        # proj_in/out, an odd modality embed) run W8A16 whatever the step policy says.
        self.gemm_ok = in_features % 16 == 0 and out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_quantizer._scale
        compute = self.compute
        if not self.gemm_ok or (compute.high_precision if self.in_layer else compute.base_high_precision):
            self.compute.w8a16_calls += 1
            return w8a16_linear(x, self.weight, scale, self.bias)
        self.compute.w8a8_calls += 1
        quantizer = getattr(self, "input_quantizer", None)  # a calibrated (static) activation scale
        return w8a8_linear(
            x,
            self.weight,
            scale,
            self.bias,
            amax_reduce=compute.amax_reduce if self.in_layer else None,
            input_amax=None if quantizer is None else quantizer._amax,
            segments=compute.segments if self.in_layer else None,
            shared=compute.shared,
        )


def quantized_linears(model: torch.nn.Module, store: TensorStore) -> list[str]:
    """Names of the model's linears whose checkpoint weight is e4m3 (the others stay high precision)."""
    names = set(store.names())
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and f"{name}.weight" in names
        and store.info(f"{name}.weight")[0] == FP8
    ]


def install_fp8(model: torch.nn.Module, store: TensorStore, compute: Fp8Compute) -> int:
    """Replace (on the meta device) every linear stored in FP8 by an `Fp8Linear`; checks each scale's
    dtype here (its presence and shape are checked with every other tensor). Returns how many."""
    names = quantized_linears(model, store)
    for name in names:
        scale = f"{name}.{SCALE}"
        if scale in store.names() and not store.info(scale)[0].is_floating_point:
            path = store.file_of(scale).path
            raise QuantizationError(f"{path}: tensor '{scale}' is {store.info(scale)[0]}, expected a float")
        parent_name, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        with torch.device("meta"):
            in_layer = name.startswith("layers.")
            new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, compute, in_layer)
            if f"{name}.{INPUT_AMAX}" in store.names():  # calibrated: W8A8 uses it (a static scale)
                new.input_quantizer = _AmaxHolder()
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    return len(names)
