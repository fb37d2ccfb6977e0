"""Reads a generated picture back into the grammar by pixel statistics alone, so a test can say whether
a prompt reached the pixels: the background is the palette colour nearest the border, the figure is the
pixels far from it, its mean colour names its colour and its centroid its place (or, frame by frame, its
motion)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cosmos3_batch.model.demo.grammar import PALETTE, SIDE, Scene

# A pixel belongs to the figure when it is this far (RGB distance) from the background colour: under half
# the distance between the two closest palette colours (red and yellow, 160), so a figure of any colour
# counts while mild noise stays background.
FIGURE_DISTANCE = 60.0
MIN_FIGURE_PIXELS = 40  # a shape covers ~600-1000 pixels; fewer than this is no figure at all
MIDDLE_FIFTH = SIDE / 10  # "center": the centroid within the middle fifth of both axes


@dataclass(frozen=True)
class Reading:
    background: str
    colour: str | None  # None: no figure found
    centroid: tuple[float, float] | None  # (x, y) in pixels


def nearest_colour(rgb: np.ndarray) -> str:
    names = list(PALETTE)
    table = np.array([PALETTE[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(((table - rgb) ** 2).sum(axis=1)))]


def read_frame(frame: np.ndarray) -> Reading:
    """frame: [H, W, 3], uint8 or float in 0..255."""
    pixels = np.asarray(frame, dtype=np.float64)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = nearest_colour(np.median(border, axis=0))
    distance = np.linalg.norm(pixels - np.array(PALETTE[background], dtype=np.float64), axis=-1)
    figure = distance > FIGURE_DISTANCE
    if figure.sum() < MIN_FIGURE_PIXELS:
        return Reading(background=background, colour=None, centroid=None)
    ys, xs = np.nonzero(figure)
    colour = nearest_colour(pixels[figure].mean(axis=0))
    return Reading(
        background=background, colour=colour, centroid=(float(xs.mean()) + 0.5, float(ys.mean()) + 0.5)
    )


def position_of(centroid: tuple[float, float]) -> str:
    x, y = centroid
    if abs(x - SIDE / 2) <= MIDDLE_FIFTH and abs(y - SIDE / 2) <= MIDDLE_FIFTH:
        return "center"
    return f"{'top' if y < SIDE / 2 else 'bottom'} {'left' if x < SIDE / 2 else 'right'}"


def direction_of(track: list[tuple[float, float]]) -> str | None:
    """The way a centroid track moves from its first to its last point; None when it barely moves."""
    dx, dy = track[-1][0] - track[0][0], track[-1][1] - track[0][1]
    if max(abs(dx), abs(dy)) < SIDE / 8:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


@dataclass(frozen=True)
class Verdict:
    """Which asked-for properties the picture shows (`place`: position for images, direction for videos)."""

    colour: bool
    background: bool
    place: bool

    @property
    def all(self) -> bool:
        return self.colour and self.background and self.place


def judge(scene: Scene, frames: np.ndarray) -> Verdict:
    """frames: [T, H, W, 3] in 0..255. An image is read once; a video's colours are read on its middle frame
    and its motion from the centroids of its first and last frames that show a figure."""
    readings = [read_frame(f) for f in frames]
    middle = readings[len(readings) // 2]
    if not scene.is_video:
        place = middle.centroid is not None and position_of(middle.centroid) == scene.position
    else:
        track = [r.centroid for r in readings if r.centroid is not None]
        place = len(track) >= 2 and direction_of(track) == scene.direction
    return Verdict(
        colour=middle.colour == scene.colour, background=middle.background == scene.background, place=place
    )
