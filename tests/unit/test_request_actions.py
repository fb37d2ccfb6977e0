"""The `action` object: the tables mirrored from the reference stay equal to it, sizes resolve to the
reference's canvas, and inputs load as validated."""

from __future__ import annotations

import json

import numpy as np
from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as ref
from diffusers.video_processor import VideoProcessor

from cosmos3_batch.requests.actions import (
    DOMAIN_WIDTHS,
    RESOLUTION_BINS,
    VIEWPOINTS,
    ActionSpec,
    canvas,
    load_actions,
)
from cosmos3_batch.requests.parse import ModelLimits, parse_lines


def test_tables_equal_the_reference():
    assert {
        int(k): {float(r): hw for r, hw in v.items()} for k, v in ref._ACTION_RESOLUTION_BINS.items()
    } == (RESOLUTION_BINS)
    assert DOMAIN_WIDTHS == ref._EMBODIMENT_TO_RAW_ACTION_DIM
    assert set(DOMAIN_WIDTHS) <= set(ref._EMBODIMENT_TO_DOMAIN_ID)
    assert tuple(ref._ACTION_VIEWPOINT_TEMPLATES) == VIEWPOINTS


def test_canvas_is_the_references_bin():
    for tier, bins in ref._ACTION_RESOLUTION_BINS.items():
        for height, width in [(40, 56), (96, 160), (720, 1280), (1000, 300), (64, 64), (250, 333)]:
            h, w = height - height % 16, width - width % 16  # preprocess_video's rounding
            expected = VideoProcessor.classify_height_width_bin(h, w, ratios=bins)
            assert canvas(int(tier), height, width, 16) == expected, (tier, height, width)


def test_inline_and_file_actions_load_as_given(tmp_path):
    rows = [[0.5] * 10, [0.25] * 10]
    inline = ActionSpec("forward_dynamics", 4, "fractal", 256, "ego_view", tuple(map(tuple, rows)))
    assert load_actions(inline).tolist() == rows
    (tmp_path / "a.json").write_text(json.dumps(rows))
    assert (
        load_actions(
            ActionSpec("forward_dynamics", 4, "fractal", 256, "ego_view", str(tmp_path / "a.json"))
        ).tolist()
        == rows
    )
    array = np.arange(20, dtype=np.float32).reshape(2, 10)
    np.save(tmp_path / "a.npy", array)
    loaded = load_actions(
        ActionSpec("forward_dynamics", 4, "fractal", 256, "ego_view", str(tmp_path / "a.npy"))
    )
    assert loaded.dtype == np.float32 and np.array_equal(loaded, array)


def test_checkpoint_limits_name_the_action_problems(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 48)).save(tmp_path / "f.png")
    line = {
        "prompt": "x",
        "image": "f.png",
        "action": {"mode": "policy", "chunk_size": 4, "domain": "hand_pose"},
    }
    raw = [json.dumps(line).encode()]
    (request,), errors = parse_lines(raw, base_dir=str(tmp_path))
    assert errors == [] and request.kind == "policy" and request.num_frames == 5
    assert (request.height, request.width) == (544, 736)  # tier 480's bin for 48x64
    _, errors = parse_lines(raw, base_dir=str(tmp_path), limits=ModelLimits(action=False))
    assert [e.field for e in errors] == ["action"] and "no action_gen" in errors[0].message
    _, errors = parse_lines(raw, base_dir=str(tmp_path), limits=ModelLimits(action=True, action_dim=32))
    assert [e.field for e in errors] == ["action.domain"] and "57 wide" in errors[0].message
