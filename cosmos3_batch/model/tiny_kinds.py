"""The checkpoint kinds `make-tiny` writes beside the base one (DESIGN.md §18): a 4-step distilled folder as
`ModularPipeline.save_pretrained` writes NVIDIA's (`--distilled`) and an Edge-shaped transformer
(`--edge`: the Nemotron backbone). model/tiny.py writes the common parts and calls in here."""

from __future__ import annotations

import json
from pathlib import Path

# The tiny distilled schedule: four sigmas from pure noise down, as a 4-step checkpoint's distilled_sigmas.
TINY_DISTILLED_SIGMAS = [1.0, 0.9375, 0.8333333, 0.625]
# Where a hub-saved distilled index points its components: the tool reads them from the folder instead.
HUB_REPO = "nvidia/Cosmos3-Super-Text2Image-4Step"


def edge_transformer_config() -> dict:
    """Cosmos3-Edge's backbone: squared-ReLU MLP (no gate projection) with Nemotron RMSNorms, and the UND
    k-norm applied to GEN queries' keys instead of per-text QK norms."""
    return {"hidden_act": "relu2", "qk_norm_for_text": False, "use_und_k_norm_for_gen": True}


def distilled_scheduler_config() -> dict:
    """FlowMatchEulerDiscreteScheduler as a distilled checkpoint ships it: stochastic (SDE) steps, no shift
    (the distilled sigmas are used as they are)."""
    return {"num_train_timesteps": 1000, "shift": 1.0, "stochastic_sampling": True}


def write_distilled(folder: Path, diffusers_version: str, tokenizer_class: str) -> None:
    """The FlowMatchEuler scheduler and modular_model_index.json in diffusers' save_pretrained layout (entries
    [library, class, loading spec], the spec naming the hub repo), with no model_index.json."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(**distilled_scheduler_config()).save_pretrained(folder / "scheduler")
    components = {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_tokenizer": ("transformers", tokenizer_class),
        "transformer": ("diffusers", "Cosmos3OmniTransformer"),
        "vae": ("diffusers", "AutoencoderKLWan"),
    }
    index = {
        "_blocks_class_name": "Cosmos3DistilledBlocks",
        "_class_name": "Cosmos3DistilledModularPipeline",
        "_diffusers_version": diffusers_version,
        "default_use_system_prompt": True,
        "distilled_sigmas": TINY_DISTILLED_SIGMAS,
        "enable_safety_checker": False,
        "is_distilled": True,
        **{
            name: [library, cls, _loading_spec(name, library, cls)]
            for name, (library, cls) in components.items()
        },
    }
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _loading_spec(subfolder: str, library: str, cls: str) -> dict:
    return {
        "pretrained_model_name_or_path": HUB_REPO,
        "revision": None,
        "subfolder": subfolder,
        "type_hint": [library, cls],
        "variant": None,
    }
