"""Held-out accuracy of a demo model: generate each held-out prompt with the reference pipeline (which our
engine equals, DESIGN.md §2) at the demo's settings and read the pictures back with the judge."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cosmos3_batch.model.demo.grammar import FPS, SIDE, VIDEO_FRAMES, Scene
from cosmos3_batch.model.demo.judge import Verdict, judge

STEPS = 30
GUIDANCE = 4.0


@dataclass(frozen=True)
class Score:
    """Counts of held-out outputs that show each asked property, out of `total`."""

    total: int
    colour: int
    background: int
    place: int
    all: int

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total,
            "colour": self.colour,
            "background": self.background,
            "place": self.place,
            "all": self.all,
        }


def score(verdicts: list[Verdict]) -> Score:
    return Score(
        total=len(verdicts),
        colour=sum(v.colour for v in verdicts),
        background=sum(v.background for v in verdicts),
        place=sum(v.place for v in verdicts),
        all=sum(v.all for v in verdicts),
    )


@torch.no_grad()
def generate(pipeline, scene: Scene, seed: int) -> np.ndarray:
    """Frames [T, H, W, 3] in 0..255 for one scene at the demo settings (30 steps, guidance 4.0)."""
    out = pipeline(
        prompt=scene.prompt,
        num_frames=VIDEO_FRAMES if scene.is_video else 1,
        height=SIDE,
        width=SIDE,
        fps=FPS,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        enable_safety_check=False,
    )
    return np.asarray(out.video, dtype=np.float64) * 255.0


def evaluate(pipeline, scenes: list[Scene], seed: int = 0) -> tuple[Score, list[np.ndarray]]:
    """Score and frames of each scene, scene i generated with seed `seed + i`."""
    frames = [generate(pipeline, scene, seed + i) for i, scene in enumerate(scenes)]
    return score([judge(s, f) for s, f in zip(scenes, frames, strict=True)]), frames
