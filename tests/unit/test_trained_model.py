"""The demo model's grammar and its judge (issue 26; no trained model ships yet): the held-out set fixed and
fair, the judge reads every drawn scene back and notices a wrong one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cosmos3_batch.model.demo import grammar
from cosmos3_batch.model.demo.judge import direction_of, judge, position_of, read_frame


def test_prompts_parse_back_into_their_scene():
    for video in (False, True):
        for scene in grammar.all_scenes(video):
            assert grammar.parse_prompt(scene.prompt) == scene
    with pytest.raises(ValueError, match="demo grammar"):
        grammar.parse_prompt("a red circle at the top left on a red background")
    with pytest.raises(ValueError, match="demo grammar"):
        grammar.parse_prompt("a purple circle moving up on a red background")


def test_held_out_set_is_fixed_and_every_word_is_also_trained():
    for video, total, held in ((False, 450, 62), (True, 360, 52)):
        kept, held_out = grammar.split_scenes(video)
        assert (len(kept) + len(held_out), len(held_out)) == (total, held)
        for field in ("colour", "shape", "background", "direction" if video else "position"):
            assert {getattr(s, field) for s in held_out} <= {getattr(s, field) for s in kept}
        assert not {s.prompt for s in kept} & {s.prompt for s in held_out}


def test_judge_reads_every_drawn_scene_back():
    rng = np.random.default_rng(0)
    for video in (False, True):
        for scene in grammar.all_scenes(video):
            assert judge(scene, grammar.draw(scene, rng)).all, scene


def test_judge_notices_a_wrong_picture():
    scene = grammar.Scene(colour="red", shape="circle", background="blue", position="top left")
    asked_green = judge(replace(scene, colour="green"), grammar.draw(scene))
    assert (asked_green.colour, asked_green.background, asked_green.place) == (False, True, True)
    asked_elsewhere = judge(replace(scene, position="bottom right"), grammar.draw(scene))
    assert (asked_elsewhere.colour, asked_elsewhere.place) == (True, False)
    clip = grammar.Scene(colour="white", shape="square", background="black", direction="left")
    assert not judge(replace(clip, direction="right"), grammar.draw(clip)).place
    blank = np.full((1, grammar.SIDE, grammar.SIDE, 3), grammar.PALETTE["yellow"], dtype=np.uint8)
    assert read_frame(blank[0]).colour is None
    assert not judge(replace(scene, background="yellow"), blank).colour


def test_positions_and_directions_from_centroids():
    assert position_of((64.0, 70.0)) == "center"
    assert position_of((30.0, 100.0)) == "bottom left"
    assert position_of((90.0, 20.0)) == "top right"
    assert direction_of([(40.0, 64.0), (90.0, 60.0)]) == "right"
    assert direction_of([(64.0, 100.0), (60.0, 40.0)]) == "up"
    assert direction_of([(64.0, 64.0), (66.0, 70.0)]) is None  # barely moves
