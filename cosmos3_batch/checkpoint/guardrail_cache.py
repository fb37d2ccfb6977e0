"""The guardrail models in the local Hugging Face cache (docs/guardrails.md), looked for before any load.

cosmos-guardrail 0.3.2's `CosmosSafetyChecker` reads `nvidia/Cosmos-1.0-Guardrail` (`blocklist/`,
`face_blur_filter/Resnet50_Final.pth`) with `snapshot_download` and `Qwen/Qwen3Guard-Gen-0.6B` with
`from_pretrained`; offline both resolve from the cache only. A job with guardrails on whose models are not
there stops with exit 2 naming them: never a job that runs without its checks. No torch here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GUARDRAIL_REPO = "nvidia/Cosmos-1.0-Guardrail"
QWEN3GUARD_REPO = "Qwen/Qwen3Guard-Gen-0.6B"
# One file per repo that the checker cannot start without (the blocklist's folder holds several).
REQUIRED = {GUARDRAIL_REPO: "face_blur_filter/Resnet50_Final.pth", QWEN3GUARD_REPO: "config.json"}
PACKAGE = "cosmos_guardrail"
# The file make-tiny writes into every folder it makes (model/tiny.py MARKER): those default to no guardrails.
MAKE_TINY_MARKER = ".written-by-cosmos3-batch-make-tiny"
DERIVED_MARKER = ".derived-from-make-tiny"  # `convert --fp8` of such a folder (checkpoint/convert.py)


class GuardrailRefusal(ValueError):
    """Guardrails are on and cannot run here (exit 2, before anything loads): `refusal()` says why."""


def written_by_make_tiny(folder: str | Path) -> bool:
    """The built-in tiny model, the demo model, any make-tiny folder: guardrails default to off for them."""
    return any((Path(folder) / name).exists() for name in (MAKE_TINY_MARKER, DERIVED_MARKER))


def missing_repos() -> list[str]:
    """The guardrail repos whose snapshot (at refs/main) the local cache lacks."""
    from huggingface_hub import try_to_load_from_cache

    return [
        repo for repo, name in REQUIRED.items() if not isinstance(try_to_load_from_cache(repo, name), str)
    ]


def refusal() -> str | None:
    """Why guardrails cannot run here (the package or its models missing), with the two ways on; else None."""
    from huggingface_hub import constants

    off = "or run with --no-guardrails (recorded in summary.json and every sidecar)"
    if importlib.util.find_spec(PACKAGE) is None:
        return (
            "guardrails are on (the default for real checkpoints) but cosmos-guardrail is not installed in "
            "this environment: use the guardrail environment (`source scripts/env.sh guardrails`, "
            "docs/guardrails.md), " + off
        )
    missing = missing_repos()
    if not missing:
        return None
    fetch = " and ".join(f"`hf download {repo}`" for repo in missing)
    return (
        f"guardrails are on (the default for real checkpoints) but {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); "
        f"nothing was loaded. Either put {'it' if len(missing) == 1 else 'them'} in the cache ({fetch} on a "
        f"machine with network, then copy the cache or point HF_HUB_CACHE at it), " + off
    )
