"""Writes a contact sheet of a demo run: each output of OUT (a `--format files` run of prompts of the demo
grammar, e.g. examples/shapes.jsonl) as a tile with its prompt and the judge's verdict under it; a video
shows its first, middle and last frames side by side.

    python scripts/tools/contact_sheet.py out/demo-shapes examples/shapes.jsonl docs/demo-contact-sheet.png
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import imageio.v3 as iio
import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cosmos3_batch.model.demo.grammar import SIDE, parse_prompt  # noqa: E402
from cosmos3_batch.model.demo.judge import judge  # noqa: E402

COLUMNS = 4
TILE_W, TEXT_H, PAD = 3 * SIDE + 8, 52, 8


def frames_of(out: Path, rid: str) -> np.ndarray:
    png = out / f"{rid}.png"
    return iio.imread(png)[None] if png.exists() else np.stack(list(iio.imiter(out / f"{rid}.mp4")))


def tile(frames: np.ndarray, prompt: str, verdict: str) -> Image.Image:
    image = Image.new("RGB", (TILE_W, SIDE + TEXT_H), "white")
    shown = [frames[0]] if len(frames) == 1 else [frames[0], frames[len(frames) // 2], frames[-1]]
    left = (TILE_W - len(shown) * (SIDE + 4) + 4) // 2
    for i, frame in enumerate(shown):
        image.paste(Image.fromarray(frame[..., :3]), (left + i * (SIDE + 4), 0))
    draw = ImageDraw.Draw(image)
    lines = [*textwrap.wrap(prompt, 62), verdict]
    for i, line in enumerate(lines[:4]):
        draw.text((4, SIDE + 2 + 12 * i), line, fill="black")
    return image


def main(out: Path, prompts: Path, sheet: Path) -> None:
    lines = [line for line in prompts.read_text().splitlines() if line.strip() and not line.startswith("#")]
    requests = [json.loads(line) for line in lines]
    tiles = []
    for request in requests:
        frames = frames_of(out, request["id"])
        v = judge(parse_prompt(request["prompt"]), frames)
        marks = f"colour {'ok' if v.colour else 'NO'}, background {'ok' if v.background else 'NO'}, "
        marks += f"{'motion' if len(frames) > 1 else 'place'} {'ok' if v.place else 'NO'}"
        tiles.append(tile(frames, request["prompt"], marks))
    rows = (len(tiles) + COLUMNS - 1) // COLUMNS
    width, height = TILE_W + PAD, SIDE + TEXT_H + PAD
    sheet_image = Image.new("RGB", (COLUMNS * width + PAD, rows * height + PAD), (230, 230, 230))
    for i, t in enumerate(tiles):
        sheet_image.paste(t, (PAD + (i % COLUMNS) * width, PAD + (i // COLUMNS) * height))
    sheet_image.save(sheet, optimize=True)
    print(f"wrote {sheet}: {len(tiles)} outputs")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
