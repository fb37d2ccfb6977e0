"""A request's defaults per checkpoint family (DESIGN.md §18): the values the reference pipeline uses for the
checkpoint at hand when a request leaves a field out. docs/requests.md has the table and where each row
comes from. model/limits.py picks the row from what the checkpoint declares; `plan` and `run` share it.
Torch-free, like the rest of request parsing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestDefaults:
    family: str  # what the row is for, as docs/requests.md names it
    image_size: tuple[int, int]  # (width, height) of a 1-frame request
    video_size: tuple[int, int]
    video_frames: int
    fps: float
    image_steps: int
    video_steps: int
    guidance: float
    flow_shift: float | None  # None = the checkpoint scheduler's own
    distilled: bool = False  # steps, guidance and sigmas are the checkpoint's: a request cannot change them


# Cosmos3-Nano and -Super: the model card's values, Cosmos3OmniPipeline's (DESIGN.md §6).
COSMOS3 = RequestDefaults("Cosmos3 (Nano, Super)", (1024, 1024), (1280, 720), 189, 24.0, 50, 35, 6.0, None)
# Cosmos3-Edge: diffusers has no Edge-specific defaults; vLLM-Omni's Edge recipe runs T2I at 640x640, T2V and
# I2V at 832x480, guidance 5.0, flow shift 3.0; frames, fps and steps as Nano's.
EDGE = RequestDefaults("Cosmos3-Edge", (640, 640), (832, 480), 189, 24.0, 50, 35, 5.0, 3.0)


def distilled(steps: int) -> RequestDefaults:
    """A 4-step distilled checkpoint: Cosmos3DistilledTextEncoderStep's 1280x720 and 189 frames for every
    request (images included), the schedule's step count, guidance baked in (1.0)."""
    return RequestDefaults(
        "Cosmos3 distilled", (1280, 720), (1280, 720), 189, 24.0, steps, steps, 1.0, None, distilled=True
    )
