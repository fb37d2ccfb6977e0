"""Transfer's request fields (DESIGN.md §17): resolved as the reference's Transfer setup step resolves them,
and every mistake reported before anything loads, line and field named, in every input format."""

from __future__ import annotations

import json

import imageio
import numpy as np
import pytest
from PIL import Image

from cosmos3_batch.plan.schedule import gen_tokens, predicted_cost
from cosmos3_batch.requests.fields import RequestError
from cosmos3_batch.requests.parse import load_requests
from cosmos3_batch.requests.transfer import chunking
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("controls")
    frames = [np.full((32, 48, 3), 20 * i, np.uint8) for i in range(9)]
    imageio.mimwrite(folder / "edge.mp4", frames, fps=8)
    imageio.mimwrite(folder / "short.mp4", frames[:5], fps=8)
    Image.fromarray(frames[0]).save(folder / "still.png")
    (folder / "bad.mp4").write_bytes(b"not a video")
    return folder


def _load(folder, rows):
    return load_requests(str(write_jsonl(folder / "r.jsonl", rows)), skip_invalid=True)


def test_a_transfer_line_resolves_as_the_reference_setup_step(media):
    rows = [
        {"id": "one", "prompt": "p", "size": "48x32", "control": {"edge": "edge.mp4"}},
        {"id": "two", "prompt": "p", "size": "48x32", "control": {"seg": "edge.mp4", "blur": "edge.mp4"},
         "num_frames": 7, "frames_per_chunk": 5, "conditional_frames": 2, "control_guidance": 1.5,
         "guidance_interval": [0, 500], "control_guidance_interval": [200, 900.5]},
    ]  # fmt: skip
    (one, two), errors = _load(media, rows)
    assert errors == []
    assert (one.kind, one.num_frames, one.width, one.height) == ("transfer", 9, 48, 32)
    spec = one.transfer
    assert spec.controls == (("edge", str(media / "edge.mp4")),)
    assert (spec.chunk_frames, spec.num_chunks, spec.stride, spec.conditional_frames) == (9, 1, 9, 1)
    assert (spec.control_guidance, spec.guidance_interval, spec.control_guidance_interval) == (
        1.0,
        None,
        None,
    )
    # Prompts verbatim: no templates; the defaults of the reference's Transfer path.
    assert (one.use_resolution_template, one.use_duration_template, one.negative_prompt) == (
        False,
        False,
        None,
    )
    spec = two.transfer
    assert spec.hints == ("blur", "seg")  # the reference's canonical order, not the line's
    assert (two.num_frames, spec.chunk_frames, spec.num_chunks, spec.stride) == (7, 5, 2, 3)
    assert (spec.guidance_interval, spec.control_guidance_interval) == ((0.0, 500.0), (200.0, 900.5))
    assert one.content_hash() != two.content_hash() and "transfer" in one.resolved()
    # plan sizes a chunk's longest sequence, every control besides the target, and costs every chunk's steps
    # at the forwards per step (48x32: 2x1 cells; a 5-frame chunk: 2 latent frames; two controls).
    assert (gen_tokens(one), gen_tokens(two)) == (2 * 3 * 2, 3 * 2 * 2)
    steps = one.num_inference_steps
    assert predicted_cost(one) == gen_tokens(one) * steps * 2  # cond, uncond (guidance above 1)
    assert predicted_cost(two) == gen_tokens(two) * steps * 2 * 3  # 2 chunks; + cond without controls


def test_the_chunk_geometry_is_the_reference_setup_steps():
    assert chunking(1, 9, 1, 4) == (1, 1, 1)  # one frame: one one-frame chunk
    assert chunking(10, None, 1, 4) == (13, 1, 13)  # rounded up to 4k+1
    assert chunking(25, 9, 1, 4) == (9, 3, 8)
    assert chunking(26, 9, 1, 4) == (9, 4, 8)
    assert chunking(25, 9, 0, 4) == (9, 3, 9)


def test_every_transfer_mistake_is_named_before_loading(media):
    rows = [
        {"prompt": "p", "control": {"foo": "edge.mp4", "depth": "auto", "blur": "bad.mp4"}, "sound": True},
        {"prompt": "p", "control": {"edge": "edge.mp4", "blur": "short.mp4"}},
        {"prompt": "p", "control": {"edge": "edge.mp4"}, "frames_per_chunk": 5, "conditional_frames": 5},
        {"prompt": "p", "control_guidance": 2.0},
        {"prompt": "p", "control": {"edge": "auto"}, "first_chunk_conditional_frames": 1},
        {"prompt": "p", "control": {}, "guidance_interval": [5, 1], "action": {"mode": "policy"}},
        {"prompt": "p", "control": {"edge": "edge.mp4"}, "num_frames": 17, "frames_per_chunk": 6},
        {"prompt": "p", "control": {"edge": "missing.mp4"}, "extra_params": {"use_duration_template": True}},
    ]
    requests, errors = _load(media, rows)
    assert requests == []
    bad, missing = media / "bad.mp4", media / "missing.mp4"
    assert errors == [
        RequestError(1, "sound", "not used by Transfer (control): remove it from this request"),
        RequestError(1, "control.foo", "unknown hint; the hints are edge, blur, depth, seg, wsm"),
        RequestError(1, "control.blur", f"{bad} is not a readable video (OSError: 'Could not load meta "
                     "information')"),
        RequestError(1, "control.depth", '"auto" needs a depth model, which this tool does not run: give '
                     "the depth control as a video file (only edge and blur are derived from the video)"),
        RequestError(2, "control.blur", "9 frames asked, but the blur control has only 5 frames"),
        RequestError(3, "conditional_frames", "conditional_frames 5 must be smaller than a chunk (5 frames): "
                     "each chunk must make at least one new frame"),
        RequestError(4, "control_guidance", "is only used with control (Transfer); add a control or "
                     "remove it"),
        RequestError(5, "control.edge", '"auto" derives Canny edges from the request\'s video: add a video'),
        RequestError(5, "first_chunk_conditional_frames", "seeds the first chunk from video: add a video"),
        RequestError(6, "action", "not used by Transfer (control): remove it from this request"),
        RequestError(6, "control", "must map at least one hint (edge, blur, depth, seg, wsm) to a control "
                     "video, got an empty object"),
        RequestError(6, "guidance_interval", "lo 5 is above hi 1"),
        RequestError(7, "num_frames", "17 frames asked, but the edge control has only 9 frames"),
        RequestError(7, "frames_per_chunk", "6 cannot be represented: use 5 or 9 (chunk frame counts "
                     "are 4k+1)"),
        RequestError(8, "control.edge", f"{missing} not found"),
        RequestError(8, "extra_params.use_duration_template", "Transfer takes its prompt verbatim "
                     "(no templates)"),
    ]  # fmt: skip


def test_a_distilled_checkpoint_refuses_transfer(media, tiny_distilled_ckpt):
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.limits import limits_for

    path = write_jsonl(media / "d.jsonl", [{"prompt": "p", "control": {"edge": "edge.mp4"}}])
    limits = limits_for(Checkpoint.open(tiny_distilled_ckpt), 10**6)
    _, errors = load_requests(str(path), limits, skip_invalid=True)
    assert [(e.field, e.message) for e in errors] == [
        ("control", "a distilled checkpoint cannot run Transfer (its blocks have no control path)")
    ]


def test_a_csv_line_goes_through_the_same_checks(media):
    """Every input format: the JSON cells of a CSV row become the same fields and the same errors."""
    rows = [
        "id,prompt,size,control,guidance_interval,control_guidance",
        'a,p,48x32,"{""edge"": ""edge.mp4""}","[0, 500]",2',
        'b,p,48x32,"{""depth"": ""auto""}",,',
    ]
    (media / "r.csv").write_text("\n".join(rows) + "\n")
    (a,), errors = load_requests(str(media / "r.csv"), skip_invalid=True)
    assert (a.transfer.guidance_interval, a.transfer.control_guidance) == ((0.0, 500.0), 2.0)
    assert [(e.line, e.field) for e in errors] == [(3, "control.depth")]
    as_json = [{"id": "a", "prompt": "p", "size": "48x32", "control": {"edge": "edge.mp4"},
                "guidance_interval": [0, 500], "control_guidance": 2}]  # fmt: skip
    (media / "r.json").write_text(json.dumps(as_json))
    (same,), _ = load_requests(str(media / "r.json"))
    assert same.content_hash() == a.content_hash()
