"""The checkpoint's sound tokenizer (joint audio): loading, latent length, decoding to a waveform."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint


def has_sound_tokenizer(model_index: dict) -> bool:
    entry = model_index.get("sound_tokenizer")
    return isinstance(entry, list) and bool(entry) and entry[0] is not None


def load_sound_tokenizer(checkpoint: Checkpoint, device: torch.device) -> torch.nn.Module | None:
    """The tokenizer as the reference loads it (from_pretrained of the local folder), or None without one."""
    if not has_sound_tokenizer(checkpoint.model_index):
        return None
    from diffusers import Cosmos3AVAEAudioTokenizer

    with warnings.catch_warnings():  # its decoder uses torch's deprecated (but exact) weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        tokenizer = Cosmos3AVAEAudioTokenizer.from_pretrained(checkpoint.root / "sound_tokenizer")
    return tokenizer.eval().requires_grad_(False).to(device)


def hop_size(config: dict) -> int:
    """Waveform samples per sound latent, as `Cosmos3AVAEAudioTokenizer` derives it from its config."""
    hop = config.get("hop_size")
    return int(hop) if hop is not None else math.prod(config.get("dec_strides", (2, 4, 5, 6, 8)))


def sound_length(num_frames: int, fps: float, sampling_rate: int, hop: int) -> int:
    """Sound latents for a clip of `num_frames` at `fps`: the reference's `T_sound` (prepare_latents)."""
    samples = int(num_frames / fps * sampling_rate)
    return (samples + hop - 1) // hop


def decode_waveform(tokenizer: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Sound latents [C, T] -> waveform [channels, samples] with the reference's own `decode_sound`."""
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.decode_sound(SimpleNamespace(sound_tokenizer=tokenizer), latents)
