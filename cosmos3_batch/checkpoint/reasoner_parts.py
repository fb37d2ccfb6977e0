"""The reasoner's parts of a checkpoint folder (DESIGN.md §21), read from its files without torch: what a
reasoner request needs beside `transformer/` (whose UND halves, `embed_tokens`, `norm` and `lm_head` the
engine serves), and what is missing when a folder lacks them, named, so a reasoner request fails with exit 2
before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

VISION_PREFIXES = ("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IMAGE_PROCESSOR = "preprocessor_config.json"


def omni_config(root: Path) -> dict | None:
    """The root config.json if it is a `cosmos3_omni` one, else None."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("model_type") == "cosmos3_omni" else None


def vision_files(root: Path) -> dict[str, list[str]]:
    """{file relative to root: [its ViT keys]}: the flat ViT keys the root index names, or vision_encoder/."""
    root = Path(root)
    index = root / "model.safetensors.index.json"
    found: dict[str, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for key, file in weight_map.items():
            if key.startswith(VISION_PREFIXES):
                found.setdefault(file, []).append(key)
    return {file: keys for file, keys in found.items() if (root / file).is_file()}


def missing_parts(root: Path) -> tuple[str, ...]:
    """What the folder lacks for the reasoner, one phrase each; () when it has every part."""
    root = Path(root)
    missing = []
    if omni_config(root) is None:
        missing.append("a root config.json of type cosmos3_omni")
    if not vision_files(root):
        missing.append(
            "the ViT's weights (flat blocks.*/merger.*/patch_embed.* keys in model.safetensors.index.json)"
        )
    absent = [name for name in (*TOKENIZER_FILES, IMAGE_PROCESSOR) if not (root / name).is_file()]
    if absent:
        missing.append(f"the processor's files at the root ({', '.join(absent)})")
    return tuple(missing + _unsupported(root))


def _unsupported(root: Path) -> list[str]:
    """Transformers the reasoner cannot point Qwen3-VL layers at yet: FP8 linears, the Edge backbone."""
    try:
        config = json.loads((root / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return []
    found = []
    if config.get("quantization_config"):
        found.append("a transformer in its stored bf16/float32 weights (the reasoner does not run FP8 yet)")
    if config.get("hidden_act", "silu") != "silu" or not config.get("qk_norm_for_text", True):
        found.append("a Qwen3-VL-shaped UND half (the Edge backbone's is not one)")
    return found
