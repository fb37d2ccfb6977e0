"""The `reason` object (issue 44 item 1): it selects kind `reason`, its fields are checked with line and
field named, generation-only fields are refused beside it, and a checkpoint without the reasoner parts is
refused."""

import json

from cosmos3_batch.requests.fields import ModelLimits
from cosmos3_batch.requests.parse import parse_lines
from cosmos3_batch.requests.reason import GENERATION_ONLY, ReasonSpec

LIMITS = ModelLimits()


def _parse(*objects, limits=LIMITS, base_dir=None):
    return parse_lines([json.dumps(o).encode() for o in objects], base_dir=base_dir, limits=limits)


def test_reason_selects_its_kind_with_the_defaults_filled_in():
    (request,), errors = _parse({"id": "a", "prompt": "Describe.", "reason": {}})
    assert errors == []
    assert request.kind == "reason"
    assert request.reason == ReasonSpec(max_new_tokens=1024, do_sample=False)
    assert request.resolved()["reason"]["max_new_tokens"] == 1024


def test_sampling_fields_become_generate_arguments():
    fields = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.1}
    line = {"id": "a", "prompt": "x", "seed": 3, "reason": {**fields, "system": "Be brief."}}
    (request,), errors = _parse(line)
    assert errors == []
    assert request.seed == 3 and request.reason.system == "Be brief."
    assert request.reason.generate_kwargs() == {"max_new_tokens": 1024, **fields}


def test_bad_fields_are_named_with_their_line():
    bad = {"max_new_tokens": 0, "top_p": 2, "do_sample": "yes", "bogus": 1, "temperature": 0}
    good = {"id": "ok", "prompt": "x", "reason": {}}
    requests, errors = _parse(good, {"id": "b", "prompt": "x", "reason": bad})
    assert [r.id for r in requests] == ["ok"]
    assert [(e.line, e.field) for e in errors] == [
        (2, "reason.bogus"),
        (2, "reason.max_new_tokens"),
        (2, "reason.temperature"),
        (2, "reason.top_p"),
        (2, "reason.do_sample"),
    ]


def test_not_an_object_and_video_fps_without_a_video():
    _, errors = _parse({"prompt": "x", "reason": 5}, {"prompt": "x", "reason": {"video_fps": 2}})
    assert [(e.line, e.field) for e in errors] == [(1, "reason"), (2, "reason.video_fps")]


def test_generation_only_fields_are_refused_beside_reason():
    assert {"num_frames", "guidance_scale", "control", "action", "size", "sound"} <= set(GENERATION_ONLY)
    line = {"prompt": "x", "reason": {}, "num_frames": 5, "guidance_scale": 3.0, "action": {"mode": "policy"}}
    _, errors = _parse(line)
    assert sorted(e.field for e in errors) == ["action", "guidance_scale", "num_frames"]
    assert all("drives generation" in e.message for e in errors)


def test_an_image_is_input_and_image_with_video_is_refused(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32), (10, 20, 30)).save(tmp_path / "a.png")
    (request,), errors = _parse({"prompt": "x", "image": "a.png", "reason": {}}, base_dir=str(tmp_path))
    assert errors == [] and request.image == str(tmp_path / "a.png") and request.kind == "reason"
    both = {"prompt": "x", "image": "a.png", "video": "a.png", "reason": {}}
    _, errors = _parse(both, base_dir=str(tmp_path))
    assert "video" in [e.field for e in errors]


def test_a_checkpoint_without_the_reasoner_parts_is_named():
    limits = ModelLimits(reasoner_missing=("root config.json of type cosmos3_omni", "the ViT weights"))
    _, errors = _parse({"prompt": "x", "reason": {}}, limits=limits)
    assert [e.field for e in errors] == ["reason"]
    assert "root config.json of type cosmos3_omni; the ViT weights" in errors[0].message


def test_other_kinds_keep_their_hash():
    (request,), _ = _parse({"id": "t", "prompt": "x", "num_frames": 1})
    assert "reason" not in request.resolved() and request.kind == "t2i"


def test_the_demos_reasoner_requests_are_valid():
    """examples/reason.jsonl (scripts/demo.sh runs it on make-tiny --reasoner): each line a reason request."""
    from pathlib import Path

    from cosmos3_batch.requests.parse import load_requests

    path = Path(__file__).resolve().parents[2] / "examples" / "reason.jsonl"
    requests, errors = load_requests(str(path))
    assert errors == [] and [r.kind for r in requests] == ["reason"] * 3
    assert [r.id for r in requests] == ["describe", "next", "score"]
