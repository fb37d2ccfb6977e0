"""The demo model's visual grammar: coloured shapes on flat backgrounds, still or moving, drawn at 128x128.

Prompts are generated from a scene and parsed back into one, so the prompts the model was trained on, the
held-out ones and those in examples/ all come from one place. numpy only: tests and the judge use it too.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

SIDE = 128  # pixels: 8x8 latents, a 4x4 grid of transformer tokens per latent frame
VIDEO_FRAMES = 9  # three latent frames (the VAE compresses time 4x after the first frame)
FPS = 24.0  # the request default: the prompt's duration template is trained at this rate

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
DIRECTIONS = ("left", "right", "up", "down")

SHAPE_SIZE = SIDE // 4  # "about a quarter of the side across"
TRAVEL = 48  # pixels a moving shape covers from the first frame to the last (over a quarter of the side)
# Where a placed shape's centre lies: the middle of its quadrant (or of the picture) plus a jitter small
# enough that a centred shape stays in the middle fifth and a cornered one stays out of it.
_QUADRANT = {"top left": (32, 32), "top right": (96, 32), "bottom left": (32, 96), "bottom right": (96, 96)}
_JITTER = {"center": 4, "corner": 8, "track": 6}
_MOTION = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class Scene:
    """One prompt of the grammar: `position` for a still image, `direction` for a 9-frame video."""

    colour: str
    shape: str
    background: str
    position: str | None = None
    direction: str | None = None

    @property
    def is_video(self) -> bool:
        return self.direction is not None

    @property
    def prompt(self) -> str:
        where = f"moving {self.direction}" if self.is_video else f"at the {self.position}"
        return f"a {self.colour} {self.shape} {where} on a {self.background} background"

    @property
    def id(self) -> str:
        where = self.direction if self.is_video else (self.position or "").replace(" ", "-")
        kind = "video" if self.is_video else "image"
        return f"{kind}-{self.colour}-{self.shape}-{where}-on-{self.background}"


_IMAGE_PROMPT = re.compile(r"a (\w+) (\w+) at the ([a-z ]+?) on a (\w+) background")
_VIDEO_PROMPT = re.compile(r"a (\w+) (\w+) moving (\w+) on a (\w+) background")


def parse_prompt(prompt: str) -> Scene:
    """The scene a prompt of the grammar asks for; ValueError for any other text."""
    if m := _IMAGE_PROMPT.fullmatch(prompt):
        scene = Scene(colour=m[1], shape=m[2], position=m[3], background=m[4])
    elif m := _VIDEO_PROMPT.fullmatch(prompt):
        scene = Scene(colour=m[1], shape=m[2], direction=m[3], background=m[4])
    else:
        raise ValueError(f"not a prompt of the demo grammar: {prompt!r}")
    ok = scene.colour in PALETTE and scene.background in PALETTE and scene.shape in SHAPES
    ok = ok and scene.colour != scene.background
    ok = ok and (scene.position in POSITIONS if not scene.is_video else scene.direction in DIRECTIONS)
    if not ok:
        raise ValueError(f"not a prompt of the demo grammar: {prompt!r}")
    return scene


def _held_out(indexes: tuple[int, ...]) -> bool:
    # One combination in eight, spread so that every colour, shape, place and background is both trained and
    # held out: the held-out scenes test new combinations of known words, never a new word.
    return sum(indexes) % 8 == 0


def all_scenes(video: bool) -> list[Scene]:
    """Every scene of the grammar in a fixed order (colour, shape, place, background)."""
    places = DIRECTIONS if video else POSITIONS
    scenes = []
    for colour, shape, place, background in itertools.product(COLOURS, SHAPES, places, COLOURS):
        if colour != background:
            where = {"direction": place} if video else {"position": place}
            scenes.append(Scene(colour=colour, shape=shape, background=background, **where))
    return scenes


def is_held_out(scene: Scene) -> bool:
    places = DIRECTIONS if scene.is_video else POSITIONS
    place = scene.direction if scene.is_video else scene.position
    indexes = (
        COLOURS.index(scene.colour),
        SHAPES.index(scene.shape),
        places.index(place),
        COLOURS.index(scene.background),
    )
    return _held_out(indexes)


def split_scenes(video: bool) -> tuple[list[Scene], list[Scene]]:
    """(trained, held out): a fixed rule, so the held-out set is the same on every machine and run."""
    scenes = all_scenes(video)
    return [s for s in scenes if not is_held_out(s)], [s for s in scenes if is_held_out(s)]


def _mask(shape: str, cx: float, cy: float) -> np.ndarray:
    """Boolean SIDExSIDE mask of one shape centred at (cx, cy), pixel centres at +0.5."""
    ys, xs = np.mgrid[0:SIDE, 0:SIDE] + 0.5
    half = SHAPE_SIZE / 2
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= half * half
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    # Apex up, base at the bottom: the width shrinks linearly from the base to the apex.
    inside_y = np.abs(dy) <= half
    return inside_y & (np.abs(dx) <= (dy + half) / 2)


def place_centre(position: str, rng: np.random.Generator | None) -> tuple[float, float]:
    if position == "center":
        base, jitter = (SIDE / 2, SIDE / 2), _JITTER["center"]
    else:
        base, jitter = _QUADRANT[position], _JITTER["corner"]
    if rng is None:
        return float(base[0]), float(base[1])
    offset = rng.uniform(-jitter, jitter, size=2)
    return float(base[0] + offset[0]), float(base[1] + offset[1])


def _paint(frames_centres: list[tuple[float, float]], scene: Scene) -> np.ndarray:
    out = np.empty((len(frames_centres), SIDE, SIDE, 3), dtype=np.uint8)
    out[:] = PALETTE[scene.background]
    for i, (cx, cy) in enumerate(frames_centres):
        out[i][_mask(scene.shape, cx, cy)] = PALETTE[scene.colour]
    return out


def draw(scene: Scene, rng: np.random.Generator | None = None) -> np.ndarray:
    """uint8 frames [T, SIDE, SIDE, 3]: one for an image, VIDEO_FRAMES for a video. Without `rng` the shape
    sits at its canonical place; with it, within the jitter of that place."""
    if not scene.is_video:
        return _paint([place_centre(scene.position or "", rng)], scene)
    mx, my = _MOTION[scene.direction or ""]
    # The track runs through the middle of the picture (mid-way along it at the middle frame), its start
    # jittered: a prompt says which way, not where, and a start anywhere made the wanted clip a spread of
    # tracks that a tiny model blurred into one unmoving smudge (held-out direction 0/8 after 1200 steps).
    jitter = (0.0, 0.0) if rng is None else tuple(rng.uniform(-_JITTER["track"], _JITTER["track"], size=2))
    start_x = SIDE / 2 - mx * TRAVEL / 2 + jitter[0]
    start_y = SIDE / 2 - my * TRAVEL / 2 + jitter[1]
    centres = []
    for frame in range(VIDEO_FRAMES):
        step = TRAVEL * frame / (VIDEO_FRAMES - 1)
        centres.append((start_x + mx * step, start_y + my * step))
    return _paint(centres, scene)


def request(scene: Scene, seed: int, steps: int = 30, guidance: float = 4.0) -> dict:
    """The JSONL request for one scene at the demo's settings (what examples/shapes.jsonl holds)."""
    return {
        "id": scene.id,
        "prompt": scene.prompt,
        "size": f"{SIDE}x{SIDE}",
        "num_frames": VIDEO_FRAMES if scene.is_video else 1,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
    }


def spread(scenes: list[Scene], count: int) -> list[Scene]:
    """`count` scenes taken evenly across the list (every colour, shape and place, not the first few)."""
    step = len(scenes) / count
    return [scenes[int(i * step)] for i in range(count)]
