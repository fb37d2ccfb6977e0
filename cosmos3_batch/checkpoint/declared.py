"""What a checkpoint folder declares about how it samples (DESIGN.md §18), read from its files alone.

A base checkpoint (Cosmos3-Nano, -Super, -Edge) names `UniPCMultistepScheduler` in `model_index.json` and its
scheduler config. A distilled one (Cosmos3-Super-Text2Image-4Step, -Image2Video-4Step) is the folder
`ModularPipeline.save_pretrained` writes: `modular_model_index.json` with `is_distilled: true`, the fixed
`distilled_sigmas` and `FlowMatchEulerDiscreteScheduler` (a stochastic Euler step whose re-noise the
request's generator draws); diffusers runs it with `Cosmos3DistilledModularPipeline`. The tool follows what
the folder declares or refuses it by name: it never runs a checkpoint with a sampler the reference would
not use. Torch-free: `plan` reads it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"
# The scheduler class a checkpoint declares -> the step the tool runs for it.
SAMPLERS = {"UniPCMultistepScheduler": "unipc", "FlowMatchEulerDiscreteScheduler": "euler"}
DISTILLED_BLOCKS = "Cosmos3DistilledBlocks"


class DeclarationError(ValueError):
    """The folder declares a sampler the tool does not run, or a distilled schedule without its sigmas."""


@dataclass(frozen=True)
class Sampler:
    """The sampler of every request on a checkpoint: `unipc` (base: the request's steps, CFG) or `euler`
    (distilled: the fixed `sigmas`, one branch per step, stochastic steps)."""

    kind: str
    sigmas: tuple[float, ...] | None = None  # distilled_sigmas; None on a base checkpoint

    @property
    def distilled(self) -> bool:
        return self.sigmas is not None

    @property
    def steps(self) -> int | None:
        """The fixed step count of a distilled schedule; None where the request chooses."""
        return None if self.sigmas is None else len(self.sigmas)


def read_indexes(root: Path) -> tuple[dict | None, dict | None]:
    """(model_index.json, modular_model_index.json) of a folder, None for a file that is not there."""
    found = []
    for name in (INDEX, MODULAR_INDEX):
        path = root / name
        found.append(json.loads(path.read_text()) if path.is_file() else None)
    return found[0], found[1]


def component_index(model_index: dict | None, modular: dict | None) -> dict:
    """model_index.json's view of the components: the file itself, else the modular index with each entry
    cut to its [library, class] (the loading spec that follows points at the hub: the folder is read)."""
    if model_index is not None:
        return model_index
    assert modular is not None
    return {k: v[:2] if isinstance(v, list) and len(v) == 3 else v for k, v in modular.items()}


def is_distilled(modular: dict | None) -> bool:
    if modular is None:
        return False
    return bool(modular.get("is_distilled")) or modular.get("_blocks_class_name") == DISTILLED_BLOCKS


def declared_sampler(root: Path, modular: dict | None, scheduler_config: dict) -> Sampler:
    """The sampler the folder declares (its scheduler config's class, its modular index's schedule); a
    DeclarationError naming the file and the class for anything else."""
    where = root / "scheduler" / "scheduler_config.json"
    name = scheduler_config.get("_class_name")
    if name not in SAMPLERS:
        raise DeclarationError(
            f"{where}: scheduler {name!r} is not one the reference pipelines run for Cosmos3 "
            f"(supported: {', '.join(SAMPLERS)})"
        )
    distilled = is_distilled(modular)
    if not distilled:
        if name != "UniPCMultistepScheduler":
            raise DeclarationError(
                f"{where}: {name} without a distilled schedule ({root / MODULAR_INDEX} with is_distilled and "
                "distilled_sigmas): Cosmos3OmniPipeline samples with UniPCMultistepScheduler"
            )
        return Sampler("unipc")
    sigmas = modular.get("distilled_sigmas")
    if not isinstance(sigmas, list) or not sigmas or not all(_is_sigma(s) for s in sigmas):
        raise DeclarationError(
            f"{root / MODULAR_INDEX}: a distilled checkpoint needs distilled_sigmas, a list of numbers in "
            f"(0, 1] (got {sigmas!r})"
        )
    if name != "FlowMatchEulerDiscreteScheduler":
        raise DeclarationError(
            f"{where}: {name} on a distilled checkpoint; Cosmos3DistilledModularPipeline samples with "
            "FlowMatchEulerDiscreteScheduler"
        )
    return Sampler("euler", tuple(float(s) for s in sigmas))


def _is_sigma(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1


def family(transformer_config: dict) -> str:
    """`edge` for the Nemotron backbone (Cosmos3-Edge: `hidden_act` relu2), else `cosmos3` (Nano, Super)."""
    return "edge" if transformer_config.get("hidden_act") == "relu2" else "cosmos3"
