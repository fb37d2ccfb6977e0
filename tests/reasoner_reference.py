"""The reference for a reasoner request: transformers' `Cosmos3OmniForConditionalGeneration.generate` on the
same messages (the checkpoint's processor and chat template), greedy, or sampled after
`torch.manual_seed(seed)`,
and a tiny checkpoint whose EOS ends sequences sharing passes at different steps. Shared by the unit and
torchrun tests of the reasoner."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch

from cosmos3_batch.model.reasoner import PresencePenalty, load_processor, messages
from cosmos3_batch.requests.reason import ReasonSpec


@functools.lru_cache(maxsize=4)
def reference_model(ckpt: str):
    from transformers import Cosmos3OmniForConditionalGeneration

    return Cosmos3OmniForConditionalGeneration.from_pretrained(ckpt).eval(), load_processor(Path(ckpt))


def reference_ids(
    ckpt: Path, prompt: str, spec: ReasonSpec, seed: int, image: str | None = None, video=None
) -> list[int]:
    """The token ids `generate` appends to the prompt (EOS included where it stopped there). `video`: (frames,
    their `VideoMetadata`, `fps` to sample at or None), as transformers' video processor takes decoded frames
    (its own fetch needs torchcodec); needs torchvision (the torchvision tier: tests/guardrails)."""
    from PIL import Image

    model, processor = reference_model(str(ckpt))
    picture = Image.open(image).convert("RGB") if image is not None else None
    frames, extra = None, {}
    if video is not None:
        frames, metadata, fps = video
        extra = {"video_metadata": [metadata], **({"fps": fps} if fps is not None else {})}
    chat = messages(prompt, spec.system, image=picture, video=frames)
    if video is None:
        inputs = processor.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
    else:  # the text from the template, then the processor called on it as its own docs call it
        text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], videos=[frames], return_tensors="pt", **extra)
    n = inputs["input_ids"].shape[1]
    extra = {"logits_processor": [PresencePenalty(spec.presence_penalty, n)]} if spec.presence_penalty else {}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, **spec.generate_kwargs(), **extra)
    return out[0, n:].tolist()


def with_eos(ckpt: Path, folder: Path, eos: list[int]) -> Path:
    """A copy of `ckpt` whose generation config ends a sequence at any of `eos` (both sides read it)."""
    copy = folder / "reasoner-eos"
    if not copy.exists():
        shutil.copytree(ckpt, copy)
    config = {
        "eos_token_id": eos,
        "pad_token_id": json.loads((ckpt / "config.json").read_text())["pad_token_id"],
    }
    (copy / "generation_config.json").write_text(json.dumps(config) + "\n")
    reference_model.cache_clear()
    return copy


def eos_between(first: list[int], second: list[int]) -> tuple[int, int]:
    """A token that ends `first` early (its first occurrence at index i < len - 1) and `second` at another
    step (or never): (the token, i). Chosen from the ids themselves, so no CPU's rounding is assumed."""
    for i, token in enumerate(first[1:-1], start=1):
        if token in first[:i]:
            continue
        at = second.index(token) if token in second else None
        if at != i:
            return token, i
    raise AssertionError(f"no token of {first} ends {second} at another step")
