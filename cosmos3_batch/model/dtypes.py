"""Which dtype each weight computes in: `--dtype` for the transformer, `--vae-dtype` for the VAE.

Both follow the rule diffusers' `from_pretrained(path, dtype=D)` applies to a model: every floating
weight is cast to D, except the weights of the class's `_keep_in_fp32_modules` (matched as diffusers
matches them: the module name anywhere in the parameter's name), which become float32. "checkpoint"
means D = the dtype the component stores its weights in, so the outputs equal
`Cosmos3OmniPipeline.from_pretrained(path, dtype={"transformer": D, "vae": V})` with the dtypes as
resolved here (docs/running.md, "Compute dtype"). FP8 checkpoints keep every tensor as stored: their
math is chosen by `--fp8-compute`, not by a cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_CHOICES = ("checkpoint", "bfloat16", "float32")  # the same tuple in config.py, which stays torch-free
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_dtype(choice: str, stored: torch.dtype) -> torch.dtype:
    """The dtype a `--dtype`/`--vae-dtype` choice computes in, for a component stored in `stored`."""
    if choice == "checkpoint":
        return stored
    if choice not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {choice!r}")
    return getattr(torch, choice)


@dataclass(frozen=True)
class DtypeRule:
    """diffusers' load-time cast, as a function of a parameter's name and stored dtype."""

    compute: torch.dtype | None  # None: as stored (FP8 checkpoints), but for the float32 modules
    keep_fp32: tuple[str, ...] = ()

    def __call__(self, name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point or stored in FP8_DTYPES:
            return stored  # e4m3 weights are never upcast, not even inside a float32 module
        if any(module in name for module in self.keep_fp32):
            return torch.float32
        return stored if self.compute is None else self.compute


def rule_for(model_class: type, choice: str, stored: torch.dtype, fp8: bool = False) -> DtypeRule:
    """The rule for a component of `model_class` whose weights are stored in `stored`."""
    keep = tuple(model_class._keep_in_fp32_modules or ())
    if fp8:
        if choice != "checkpoint":
            raise ValueError("an FP8 checkpoint computes as stored: --dtype must be checkpoint")
        return DtypeRule(None, keep)
    return DtypeRule(resolve_dtype(choice, stored), keep)


def apply_rule(
    module: torch.nn.Module, rule: DtypeRule, prefix: str = "", skip: tuple[str, ...] = ()
) -> None:
    """Cast `module`'s parameters (meta or real) in place by `rule`; names are `prefix` + the parameter's
    name, as in the checkpoint. Parameters whose name starts with one of `skip` are left as they are."""
    for name, param in list(module.named_parameters()):
        full = prefix + name
        want = rule(full, param.dtype)
        if want != param.dtype and not full.startswith(skip):
            owner, _, leaf = name.rpartition(".")
            parent = module.get_submodule(owner) if owner else module
            parent._parameters[leaf] = torch.nn.Parameter(param.detach().to(want), requires_grad=False)


def stored_dtype(infos: list[tuple[torch.dtype, tuple[int, ...]]]) -> torch.dtype:
    """The dtype a component stores its weights in: the one holding most bytes among its floating,
    non-FP8 tensors (a bf16 release with a few float32 norms is bf16). From headers only."""
    totals: dict[torch.dtype, int] = {}
    for dtype, shape in infos:
        if dtype.is_floating_point and dtype not in FP8_DTYPES:
            totals[dtype] = totals.get(dtype, 0) + dtype.itemsize * _numel(shape)
    return max(totals, key=totals.__getitem__) if totals else torch.float32


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
