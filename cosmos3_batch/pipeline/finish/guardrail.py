"""NVIDIA's guardrails as the reference runs them (DESIGN.md §23, docs/guardrails.md): cosmos-guardrail's own
`CosmosSafetyChecker`, loaded once per rank on its device, offline.

Text: the string diffusers' `Cosmos3OmniPipeline.__call__` hands `check_text_safety` (the request's prompt as
given, before any template), through the same runner (`text_guardrail.run_safety_check`), which also says why.
Video: the decoded frames as the reference hands them to `check_video_safety` (`(video * 255).astype(uint8)`
of its float frames, [T, H, W, C]); what comes back (faces pixelated) is what is encoded, or None: blocked.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from cosmos3_batch.pipeline.kinds.denoise import Result

# A test hook: called with (request id, the uint8 frames handed to the encoder) after each video check.
on_checked: Callable[[str, np.ndarray], None] | None = None


class Guardrails:
    """The checker on this rank's device; `text` and `video` are the reference's two checks."""

    def __init__(self, device: torch.device):
        os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded at run time (read before its import)
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True  # already imported by diffusers: the switch it reads at each call
        from cosmos_guardrail import CosmosSafetyChecker

        self.checker = CosmosSafetyChecker()
        self.checker.to(device)
        self.device = device
        # The loop's thread checks upsampled prompts while the finisher's checks replies: one tokenizer,
        # which (a Rust one) refuses to be used by two threads at once ("Already borrowed").
        self._text_lock = threading.Lock()

    @torch.no_grad()
    def text(self, prompt: str) -> str | None:
        """None: the prompt passes; else the guardrail's reason (which check, and what it found)."""
        with self._text_lock:
            safe, message = self.checker.text_guardrail.run_safety_check(prompt)
        return None if safe else message

    @torch.no_grad()
    def video(self, frames: np.ndarray) -> np.ndarray | None:
        """uint8 [T, H, W, C] -> the frames to encode (faces pixelated), or None (blocked)."""
        return self.checker.check_video_safety(frames)


def check_result(guard: Guardrails, request_id: str, result: Result, timings: dict) -> Result | None:
    """A decoded request's frames through the video guardrail, as the reference's `output_type="np"` path
    converts them; the result to write (its frames uint8, which `outputs.to_uint8` passes through), or None
    when the guardrail blocked the video."""
    start = time.perf_counter()
    frames = (result.frames * 255).astype(np.uint8)  # the reference's conversion (it truncates)
    checked = guard.video(frames)
    timings["guardrail_s"] = timings.get("guardrail_s", 0.0) + time.perf_counter() - start
    if checked is None:
        return None
    checked = np.ascontiguousarray(checked, dtype=np.uint8)
    if on_checked is not None:
        on_checked(request_id, checked)
    return dataclasses.replace(result, frames=checked)


VIDEO_BLOCKED = "the video guardrail rejected the generated frames"


def withhold_unsafe_answers(guard: Guardrails, texts: dict[str, dict]) -> None:
    """Captions and scores (kinds/chained.py) are reasoner replies, checked as NVIDIA's CLI checks a
    reasoner's text: an answer the text guardrail blocks keeps its counts but loses its text, its token ids
    (they decode to the same text) and its score, and says why; the generated media, which passed the video
    check, is written."""
    for answer in texts.values():
        if answer.get("text") is not None and (why := guard.text(answer["text"])) is not None:
            answer.update(text=None, token_ids=None, blocked=why)
            if "score" in answer:
                answer["score"] = None
