"""The trained demo model (DESIGN.md §16): where its weights ship (cosmos3_batch/model/trained_tiny/), what
is recorded beside them (the command that made them, their digests, the held-out accuracy) and how
`make-tiny --trained` writes a checkpoint folder from them."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from cosmos3_batch.model.tiny import (
    MARKER,
    TinySpec,
    model_index,
    publish_folder,
    transformer_config,
    vae_config,
)

SHIPPED = Path(__file__).resolve().parents[1] / "trained_tiny"
RECORD = "demo_model.json"  # beside the weights: the command that made them, their digests, the accuracy
COMPONENTS = ("transformer", "vae", "scheduler", "text_tokenizer")

# The demo model's shape: 4 layers of hidden 128 learn this grammar in minutes on two CPU cores.
DEMO_SPEC = TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=384, vae_dim=8, flow_shift=3.0)


ROPE_THETA = 50.0


class TrainedModelError(RuntimeError):
    """The shipped weights are missing or do not match the digests recorded beside them."""


def demo_vae_config(generator) -> dict:
    """The make-tiny VAE with one spatial downsampling fewer: 8x instead of 16x, so a 128x128 picture is a
    16x16 latent and a shape a quarter of the side across spans 4x4 latent pixels. At 16x (base dim 8 or
    16) the figure did not survive the VAE after 1000 steps; at 8x the held-out reconstructions show the
    asked colour, background and place (docs/demo-model.md)."""
    config = vae_config(DEMO_SPEC, generator)
    config.update(dim_mult=[1, 2, 2], temperal_downsample=[True, True], scale_factor_spatial=8)
    return config


def demo_transformer_config(vocab_size: int) -> dict:
    """The make-tiny transformer at DEMO_SPEC with rotary base 50 instead of the released 5e6.

    A head of 32 dims has 16 rotary frequencies, 5 per spatial axis. At base 5e6 only one of those 5 turns
    more than 0.02 rad per latent patch, so a token barely knows where in the picture it is and placement
    is not learned (2/16 held-out pictures placed right after 500 steps); at base 50 they turn 0.78 to
    0.04 rad per patch, each telling the 8 patches of a side apart (8/16 after the same 500 steps)."""
    return {**transformer_config(DEMO_SPEC, vocab_size=vocab_size), "rope_theta": ROPE_THETA}


def demo_model_index() -> dict:
    index = model_index(DEMO_SPEC)
    # Trained without the reference's system prompt: it would add ~75 tokens to every sequence and say
    # nothing the grammar needs. The reference pipeline reads this default, so a request gets the same.
    index["default_use_system_prompt"] = False
    return index


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of the components, by path relative to `folder`."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for name in COMPONENTS
        for p in sorted((folder / name).rglob("*"))
        if p.is_file()
    }


def combined_digest(digests: dict[str, str]) -> str:
    """One sha256 for the whole model: of the sorted `digest  path` lines, as `sha256sum` prints them."""
    lines = "".join(f"{digest}  {path}\n" for path, digest in sorted(digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def shipped_record(source: Path = SHIPPED) -> dict:
    record_path = source / RECORD
    if not record_path.is_file():
        raise TrainedModelError(
            f"no trained demo model at {source} (missing {RECORD}); "
            "make one with python scripts/train_tiny.py"
        )
    return json.loads(record_path.read_text())


def write_trained(out_dir: Path, source: Path = SHIPPED) -> Path:
    """Write a complete checkpoint folder (model_index.json, the four components, the make-tiny marker)
    from the shipped weights, atomically: a temporary sibling, every file checked against the recorded
    digests, then a rename over `out_dir`. Callers check `out_dir` with `check_replaceable` first."""
    record = shipped_record(source)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name in COMPONENTS:
            shutil.copytree(source / name, tmp / name)
        digests = file_digests(tmp)
        if digests != record["files"]:
            changed = sorted(set(digests.items()) ^ set(record["files"].items()))
            raise TrainedModelError(
                f"the trained demo model at {source} does not match the digests in its {RECORD} "
                f"({', '.join(sorted({path for path, _ in changed}))}): reinstall the package"
            )
        shutil.copy2(source / RECORD, tmp / RECORD)
        (tmp / "model_index.json").write_text(json.dumps(demo_model_index(), indent=2) + "\n")
        (tmp / MARKER).write_text("This folder was written by `cosmos3-batch make-tiny --trained`.\n")
        publish_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
