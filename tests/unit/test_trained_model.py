"""The demo model (issue 26): the grammar's held-out set fixed and fair, the judge reads every drawn scene
back and notices a wrong one, the figure's place on the latent grid, and `make-tiny --trained` writing the
shipped weights only when they match their recorded digests. That the model draws what it is asked is
tests/dist/test_demo_model.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model.demo import grammar, trained
from cosmos3_batch.model.demo.judge import direction_of, judge, position_of, read_frame
from cosmos3_batch.model.demo.train_vae import figure_mask
from cosmos3_batch.model.tiny import MARKER, build_tokenizer


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


def test_a_corpus_makes_each_of_its_words_one_token_and_other_text_still_tokenizes():
    plain = build_tokenizer()
    words = build_tokenizer(["a red circle at the top left. This image is of 128x128 resolution."])
    assert len(plain) == 260  # the random tiny model's vocabulary, unchanged
    pieces = words.tokenize("a red circle at the top left")
    assert pieces == ["a", "Ġred", "Ġcircle", "Ġat", "Ġthe", "Ġtop", "Ġleft"]
    unseen = "a red lighthouse at the cliff, ünïcode"
    assert words.decode(words(unseen)["input_ids"]) == unseen
    assert len(words(unseen)["input_ids"]) < len(plain(unseen)["input_ids"])  # " red", " at", " the"


def test_figure_mask_marks_the_latent_pixels_the_figure_covers():
    still = grammar.Scene(colour="red", shape="square", background="blue", position="top left")
    mask = figure_mask(grammar.draw(still), still, spatial=8, temporal=4)
    assert mask.shape == (1, 1, 1, 16, 16)
    # The canonical square covers pixels 16..47 on both axes: latent pixels 2..5, all 16 of them.
    assert mask[0, 0, 0].nonzero().tolist() == [[y, x] for y in range(2, 6) for x in range(2, 6)]
    clip = grammar.Scene(colour="white", shape="circle", background="black", direction="right")
    moving = figure_mask(grammar.draw(clip), clip, spatial=8, temporal=4)
    assert moving.shape == (1, 1, 3, 16, 16)  # frame 0 alone, then frames 1-4 and 5-8
    first, last = (moving[0, 0, t].nonzero()[:, 1].float().mean() for t in (0, 2))
    assert last - first >= 4  # moved right by half its travel or more, in latent pixels


def _fake_shipped(folder: Path) -> Path:
    for name in trained.COMPONENTS:
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text(json.dumps({"component": name}))
    digests = trained.file_digests(folder)
    record = {"digest": trained.combined_digest(digests), "files": digests}
    (folder / trained.RECORD).write_text(json.dumps(record))
    return folder


def test_write_trained_copies_only_weights_that_match_their_digests(tmp_path):
    source = _fake_shipped(tmp_path / "shipped")
    out = trained.write_trained(tmp_path / "model", source)
    assert trained.file_digests(out) == trained.file_digests(source)
    assert json.loads((out / "model_index.json").read_text())["default_use_system_prompt"] is False
    assert (out / MARKER).is_file() and (out / trained.RECORD).is_file()
    (source / "vae" / "config.json").write_text("{}")  # a changed file: refused, the earlier copy kept
    with pytest.raises(trained.TrainedModelError, match=r"vae/config\.json"):
        trained.write_trained(out, source)
    assert trained.file_digests(out) != trained.file_digests(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "shipped"]  # no temporary left


def test_make_tiny_trained_writes_the_shipped_model(tmp_path):
    args = ["make-tiny", str(tmp_path / "demo"), "--trained"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = trained.shipped_record()
    assert trained.file_digests(tmp_path / "demo") == record["files"]
    assert trained.combined_digest(record["files"]) == record["digest"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "other"), "--trained"])
    assert result.exit_code == 2 and (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_train_tiny_quick_writes_a_model_make_tiny_trained_accepts(tmp_path):
    """The training script end to end at a few steps (the recipe, the record, the layout write_trained
    reads), so a change that breaks retraining fails here and not on the next person to retrain."""
    out = tmp_path / "quick"
    script = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"
    args = [sys.executable, str(script), "--quick", "--threads", "1", "--out", str(out)]
    subprocess.run(args, check=True, capture_output=True, timeout=600)
    record = trained.shipped_record(out)
    assert record["command"] == f"python scripts/train_tiny.py --quick --threads 1 --out {out}"
    assert record["files"] == trained.file_digests(out)
    for kind in ("images", "videos"):
        assert record["held_out_accuracy"][kind]["total"] == 1
    model = trained.write_trained(tmp_path / "model", out)
    assert json.loads((model / "transformer" / "config.json").read_text())["rope_theta"] == trained.ROPE_THETA
