"""`make-tiny --sound --action`: deterministic, loads in the reference pipeline; without flags, the embedded
default keeps the exact bytes (and cache folder) it had before the mode flags existed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model.tiny import MARKER, TinySpec, default_tiny_dir, spec_record, write_tiny

# sha256 over (relative path, sha256 of content) of every file of `make-tiny DIR` as built before the mode
# flags existed (torch 2.13.0, diffusers 0.42.1: the versions the project pins).
DEFAULT_DIGEST = "d34145175f513148ee08216bcc1d421d33a2ef168de39bfd4feff816f77ba011"


def folder_digest(root: Path) -> str:
    """The checkpoint's files; make-tiny's ownership marker is not part of the checkpoint."""
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER):
        digest.update(str(file.relative_to(root)).encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


@pytest.mark.exact  # randn's bits follow ATen's capability: run again one instruction set lower
def test_default_checkpoint_bytes_are_unchanged(tiny_ckpt, tmp_path, cpu_branch):
    """torch's CPU randn draws its normals with vector code whose bits depend on ATen's capability (AVX2 and
    AVX512 agree; `default` differs): the recorded digest is theirs. Elsewhere the checkpoint must still be
    the same bytes every time it is built."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        cpu_branch(f"tiny checkpoint: ATen {capability} -> the recorded digest")
        assert folder_digest(tiny_ckpt) == DEFAULT_DIGEST
    else:
        cpu_branch(f"tiny checkpoint: ATen {capability} -> no recorded digest; rebuilt bytes equal")
        assert folder_digest(write_tiny(tmp_path / "again", TinySpec())) == folder_digest(tiny_ckpt)
    assert (tiny_ckpt / MARKER).is_file()
    assert "sound" not in spec_record(TinySpec()) and "action" not in spec_record(TinySpec())
    assert default_tiny_dir().name == "tiny-693600be6fe8"


def test_sound_action_checkpoint_is_deterministic_and_complete(tmp_path, tiny_av_ckpt):
    result = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "again"), "--sound", "--action"])
    assert result.exit_code == 0, result.output
    assert folder_digest(tmp_path / "again") == folder_digest(tiny_av_ckpt)
    index = json.loads((tiny_av_ckpt / "model_index.json").read_text())
    assert index["sound_tokenizer"] == ["diffusers", "Cosmos3AVAEAudioTokenizer"]
    config = json.loads((tiny_av_ckpt / "transformer" / "config.json").read_text())
    assert config["sound_gen"] and config["action_gen"] and config["action_dim"] == 57
    sound = json.loads((tiny_av_ckpt / "sound_tokenizer" / "config.json").read_text())
    assert sound["sampling_rate"] == 48000 and sound["dec_out_channels"] == 2


def test_sound_only_checkpoint_has_no_action_head(tmp_path):
    path = write_tiny(tmp_path / "s", TinySpec(sound=True))
    config = json.loads((path / "transformer" / "config.json").read_text())
    assert config["sound_gen"] and not config.get("action_gen", False)
    assert json.loads((path / "tiny_spec.json").read_text())["sound"] is True
