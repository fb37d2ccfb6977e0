"""The trained demo model draws what it is asked, through the whole engine (DESIGN.md §16, issue 26).

One real torchrun launch, 2 ranks over gloo, weights gathered per layer part (--offload allgather): held-out
prompts of the grammar (combinations the model never saw) at the demo's settings, 30 steps, guidance 4.0,
a different seed each. The written PNGs and MP4s are read back by the judge's pixel statistics alone."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest

from cosmos3_batch.model.demo import grammar
from cosmos3_batch.model.demo.judge import judge
from cosmos3_batch.model.demo.trained import write_trained
from tests.conftest import write_jsonl
from tests.dist.jobs import torchrun_jobs

pytestmark = pytest.mark.dist

# Every held-out prompt: 62 pictures and 52 clips (measured here: 61 and 46 right, docs/demo-model.md).
IMAGES, VIDEOS = 62, 52
REQUIRED = 0.9  # the bar for pictures: 90% show the asked colour, background and place together
# Clips are asked to move the asked way; the bar sits below the 88% measured here (46/52) by the few clips
# another CPU's rounding may tip across the judge's 16-pixel line (the misses here move 8-15 pixels).
REQUIRED_MOTION = 0.85


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    model = write_trained(folder / "model")
    scenes = grammar.split_scenes(video=False)[1] + grammar.split_scenes(video=True)[1]
    prompts = write_jsonl(
        folder / "held_out.jsonl", [grammar.request(s, seed=100 + i) for i, s in enumerate(scenes)]
    )
    out = folder / "out"
    job = ["run", prompts, "--model", model, "--out", out, "--offload", "allgather"]
    assert torchrun_jobs(2, [job], folder / "launch") == [0]
    return scenes, out


def _frames(out, scene: grammar.Scene) -> np.ndarray:
    if scene.is_video:
        return np.stack(list(iio.imiter(out / f"{scene.id}.mp4")))
    return iio.imread(out / f"{scene.id}.png")[None]


def test_held_out_images_show_the_asked_colour_background_and_place(outputs):
    scenes, out = outputs
    verdicts = {s.id: judge(s, _frames(out, s)) for s in scenes if not s.is_video}
    wrong = {sid: v for sid, v in verdicts.items() if not v.all}
    assert len(verdicts) == IMAGES
    assert len(wrong) <= (1 - REQUIRED) * IMAGES, json.dumps({k: vars(v) for k, v in wrong.items()}, indent=1)


def test_held_out_videos_move_the_asked_way(outputs):
    scenes, out = outputs
    verdicts = {s.id: judge(s, _frames(out, s)) for s in scenes if s.is_video}
    wrong = [sid for sid, v in verdicts.items() if not v.place]
    assert len(verdicts) == VIDEOS
    assert len(wrong) <= (1 - REQUIRED_MOTION) * VIDEOS, wrong
