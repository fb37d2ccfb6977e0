"""Writes examples/clip.mp4, the small clip the demo's video-to-video request continues.

Deterministic: the frames are a formula, and x264 runs single-threaded with the bundled ffmpeg, so a rerun
gives the same bytes (the file is committed; this script documents how it was made).
"""

from __future__ import annotations

import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np


def frames(count: int = 9, height: int = 96, width: int = 160) -> list[np.ndarray]:
    y, x = np.mgrid[0:height, 0:width]
    return [
        np.stack(
            [(x * 255 // width + 20 * t) % 256, y * 255 // height, ((x + y + 15 * t) % 64) * 4], axis=-1
        ).astype(np.uint8)
        for t in range(count)
    ]


def main(path: str = "examples/clip.mp4") -> None:
    writer = imageio.get_writer(
        Path(path),
        format="FFMPEG",
        fps=8,
        codec="libx264",
        pixelformat="yuv420p",
        quality=8,
        macro_block_size=16,
        ffmpeg_log_level="error",
        output_params=["-threads", "1"],
    )
    try:
        for frame in frames():
            writer.append_data(frame)
    finally:
        writer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
