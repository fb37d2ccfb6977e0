"""Hostile request files and --out folders through the real `run`: exit 2, every problem named with its
line and field, nothing written, and no weight loaded (DESIGN.md §6)."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pytest.mark import ParameterSet
from PIL import Image
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.pipeline.job import load as job_load
from cosmos3_batch.pipeline.job import run as job
from tests.unit.test_faults import tmpfs

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
VALID = {"id": "ok", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
VIDEO = {"prompt": "a cat", "num_frames": 9, "size": "32x32", "num_inference_steps": 1}


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("got past planning (collective or weight loading) on input that should stop it")

    monkeypatch.setattr(job_load, "load_context", refuse)
    monkeypatch.setattr(job_load, "build_weights", refuse)
    monkeypatch.setattr(job, "_check_same_plan", refuse)  # the first collective after planning


def jsonl(*rows: dict | str | bytes) -> bytes:
    """One line per row: dicts as JSON, str/bytes verbatim (for what json.dumps cannot produce)."""
    lines = [
        json.dumps(r).encode() if isinstance(r, dict) else r if isinstance(r, bytes) else r.encode()
        for r in rows
    ]
    return b"".join(line + b"\n" for line in lines)


def case(
    content: bytes,
    *expected: str,
    args: tuple[str, ...] = (),
    absent: tuple[str, ...] = (),
    id: str,
) -> ParameterSet:
    return pytest.param(content, expected, args, absent, id=id)


def bad(row: dict | str | bytes, field: str | None, message: str, *more: str, **kw: Any) -> ParameterSet:
    """Line 1 valid, line 2 `row`: the output must say "line 2, field '<field>': <message>" (and `more`)."""
    where = f"line 2, field '{field}'" if field else "line 2"
    return case(jsonl(VALID, row), f"{where}: {message}", *more, **kw)


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _image(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


def act(**changes: Any) -> dict:
    """A valid forward-dynamics line (image + 10-wide fractal actions) with `changes` (None drops a key)."""
    action = {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal", "actions": [[0.0] * 10]}
    row: dict[str, Any] = {"prompt": "push", "image": "good.png", "action": action}
    for key, value in changes.items():
        target = (
            action
            if key in ("mode", "chunk_size", "domain", "resolution_tier", "viewpoint", "actions", "extra")
            else row
        )
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    return row


LONG = "a" * 5000  # the tiny byte-level tokenizer: one token per byte, model_max_length 4096
OVER_MODEL = "exceed the limit of 4096 (the model)"

CASES = [
    # Not JSON, or not one object per line.
    bad('{"prompt": "x",', None, "not valid JSON", id="json-unterminated"),
    bad('{"prompt": "x"} trailing', None, "not valid JSON", id="json-trailing-garbage"),
    bad('["prompt", "x"]', None, "each line must be a JSON object, got an array", id="json-array"),
    bad('"just a string"', None, "each line must be a JSON object", id="json-string"),
    bad("{" * 100_000, None, "not valid JSON", id="json-nested-too-deep"),
    # Wrong types.
    bad({"prompt": 5}, "prompt", "must be a string, got 5", id="type-prompt-int"),
    bad({**VIDEO, "num_frames": "9"}, "num_frames", "must be an integer", id="type-frames-str"),
    bad(
        {**VIDEO, "num_inference_steps": 3.0},
        "num_inference_steps",
        "must be an integer",
        id="type-steps-float",
    ),
    bad({"prompt": "x", "size": 512}, "size", 'must be "WIDTHxHEIGHT"', id="type-size-int"),
    bad({"prompt": "x", "size": "32X32"}, "size", 'must be "WIDTHxHEIGHT"', id="type-size-uppercase-x"),
    bad(
        {"prompt": "x", "negative_prompt": ["a"]},
        "negative_prompt",
        "must be a string",
        id="type-negative-list",
    ),
    bad({"prompt": "x", "extra_params": [1]}, "extra_params", "must be an object", id="type-extra-list"),
    bad({"prompt": "x", "image": 3}, "image", "must be a string, got 3", id="type-image-int"),
    bad({"prompt": "x", "id": 7}, "id", "must be a string, got 7", id="type-id-int"),
    # Booleans where numbers belong (bool is an int in Python).
    bad({"prompt": "x", "seed": True}, "seed", "must be an integer, got a boolean (true)", id="bool-seed"),
    bad(
        {"prompt": "x", "guidance_scale": False},
        "guidance_scale",
        "must be a number, got a boolean",
        id="bool-cfg",
    ),
    bad(
        {"prompt": "x", "num_frames": True},
        "num_frames",
        "must be an integer, got a boolean",
        id="bool-frames",
    ),
    bad(
        {"prompt": "x", "width": True, "height": 32},
        "width",
        "must be an integer, got a boolean",
        id="bool-width",
    ),
    bad(
        {"prompt": "x", "extra_params": {"use_resolution_template": 1}},
        "extra_params.use_resolution_template",
        "must be true or false, got 1",
        id="number-for-bool",
    ),
    # Non-finite numbers.
    bad('{"prompt": "x", "guidance_scale": NaN}', "guidance_scale", "must be a number, got NaN", id="nan"),
    bad('{"prompt": "x", "fps": Infinity}', "fps", "must be a number, got Infinity", id="inf"),
    bad(
        '{"prompt": "x", "flow_shift": -Infinity}', "flow_shift", "must be a number, got -Infinity", id="-inf"
    ),
    bad('{"prompt": "x", "guidance_scale": 1e999}', "guidance_scale", "must be finite, got inf", id="1e999"),
    bad('{"prompt": "x", "seed": 1e999}', "seed", "must be an integer, got inf", id="1e999-seed"),
    bad('{"prompt": "x", "seed": 1' + "0" * 5000 + "}", None, "not valid JSON: a number has", id="huge-int"),
    # Unknown and repeated keys.
    bad({"prompt": "x", "promt": "y"}, "promt", "unknown key 'promt'", "did you mean", id="unknown-key"),
    bad(
        {"prompt": "x", "extra_params": {"tiles": 1}}, "extra_params.tiles", "unknown key", id="unknown-extra"
    ),
    bad('{"prompt": "x", "seed": 1, "seed": 2}', "seed", "key appears more than once", id="repeated-key"),
    # Ids.
    bad({**VIDEO, "id": "ok"}, "id", "duplicate id 'ok': already used on line 1", id="id-duplicate"),
    case(
        jsonl({**VALID, "id": None}, {"prompt": "x", "id": "line000001"}),
        "line 2, field 'id': duplicate id 'line000001': already used on line 1",
        id="id-duplicate-derived",
    ),
    bad({"prompt": "x", "id": "a/b"}, "id", "'a/b' is not a safe file name", id="id-slash"),
    bad(
        {"prompt": "x", "id": "/etc/passwd"}, "id", "'/etc/passwd' is not a safe file name", id="id-absolute"
    ),
    bad({"prompt": "x", "id": "a\\b"}, "id", "'a\\\\b' is not a safe file name", id="id-backslash"),
    bad({"prompt": "x", "id": ".."}, "id", "'..' is not a safe file name", id="id-dotdot"),
    bad({"prompt": "x", "id": "a..b"}, "id", "'a..b' is not a safe file name", id="id-inner-dotdot"),
    bad({"prompt": "x", "id": "../x"}, "id", "'../x' is not a safe file name", id="id-parent"),
    bad({"prompt": "x", "id": "a\u0000b"}, "id", "'a\\x00b' is not a safe file name", id="id-nul"),
    bad({"prompt": "x", "id": ".hidden"}, "id", "'.hidden' is not a safe file name", id="id-leading-dot"),
    bad({"prompt": "x", "id": ""}, "id", "'' is not a safe file name", id="id-empty"),
    bad({"prompt": "x", "id": "x" * 129}, "id", "'xxx", "is not a safe file name", id="id-too-long"),
    bad({"prompt": "x", "id": "Summary"}, "id", "'Summary' is reserved", id="id-reserved"),
    # Prompts.
    bad({"prompt": ""}, "prompt", "must not be empty", id="prompt-empty"),
    bad({"prompt": " \t "}, "prompt", "must not be empty", id="prompt-whitespace"),
    bad({"seed": 1}, "prompt", "missing", id="prompt-missing"),
    bad({"prompt": None}, "prompt", "missing", id="prompt-null"),
    bad('{"prompt": "\\ud800"}', "prompt", "contains an unpaired surrogate", id="prompt-lone-surrogate"),
    bad({**VALID, "id": "long", "prompt": LONG}, "prompt", "", OVER_MODEL, id="prompt-over-token-limit"),
    bad(
        {**VALID, "id": "long", "negative_prompt": LONG},
        "negative_prompt",
        "",
        OVER_MODEL,
        id="negative-over-limit",
    ),
    # Sizes and frame counts beyond the bounds.
    bad(
        {"prompt": "x", "size": "4096x4096", "num_frames": 17},
        "num_frames",
        "4096x4096 x 17 frames is 81,920 vision tokens, over the per-request bound of 65,536",
        id="bound-size",
    ),
    bad(
        {"prompt": "x", "size": "1280x720", "num_frames": 289},
        "num_frames",
        "1280x720 x 289 frames is 67,160 vision tokens, over the per-request bound of 65,536",
        id="bound-frames",
    ),
    bad(
        {"prompt": "x", "num_frames": 1, "size": "256x256"},
        "size",
        "256x256 x 1 frames is 64 vision tokens, over the per-request bound of 16",
        args=("--max-vision-tokens", "16"),
        id="bound-lowered",
    ),
    case(  # the same request as bound-size passes with a raised bound; line 3 still stops the job
        jsonl(VALID, {"prompt": "x", "size": "4096x4096", "num_frames": 17}, {"prompt": "x", "seed": True}),
        "line 3, field 'seed'",
        args=("--max-vision-tokens", "100000"),
        absent=("vision tokens", "line 2"),
        id="bound-raised-accepts",
    ),
    bad(
        {"prompt": "x", "size": "8192x64", "num_frames": 1},
        "size",
        "8192x64: width 8192 exceeds",
        id="side-max",
    ),
    bad(
        {"prompt": "x", "size": "0x32", "num_frames": 1},
        "size",
        "0x32: width must be positive",
        id="side-zero",
    ),
    bad(
        {"prompt": "x", "size": "50x32", "num_frames": 1},
        "size",
        "50x32: width 50 is not a multiple",
        id="side-odd",
    ),
    bad(
        {"prompt": "x", "num_frames": 2001},
        "num_frames",
        "num_frames 2001 exceeds the maximum",
        id="frames-max",
    ),
    bad({"prompt": "x", "num_frames": 0}, "num_frames", "num_frames must be >= 1", id="frames-zero"),
    bad(
        {"prompt": "x", "num_frames": 10},
        "num_frames",
        "num_frames 10 cannot be represented",
        id="frames-4k+2",
    ),
    bad({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "must be >= 1", id="steps-zero"),
    bad({"prompt": "x", "seed": -1}, "seed", "must be >= 0", id="seed-negative"),
    # Bytes that are not UTF-8.
    bad(b'{"prompt": "caf\xe9"}', None, "not valid UTF-8 (byte 0xe9", id="latin1"),
    bad(b'{"prompt": "\xff\xfe"}', None, "not valid UTF-8 (byte 0xff", id="invalid-utf8"),
    # Files with no request at all (so no valid line either).
    case(b"", "no requests in file", id="empty-file"),
    case(b"\n   \n\n", "no requests in file", id="blank-lines-only"),
    case(b"# only a comment\n", "no requests in file", id="comments-only"),
    # The conditioning image (relative paths resolve next to the JSONL file).
    bad({**VIDEO, "image": "missing.png"}, "image", "image file not found", id="image-missing"),
    bad({**VIDEO, "image": "."}, "image", "image file not found", id="image-is-folder"),
    bad({**VIDEO, "image": ""}, "image", "must be a path to an image file", id="image-empty"),
    bad({**VIDEO, "image": "text.png"}, "image", "", "is not a readable image", id="image-not-image"),
    bad({**VIDEO, "image": "half.png"}, "image", "", "is not a readable image", id="image-truncated-png"),
    bad({**VIDEO, "image": "head.jpg"}, "image", "", "is not a readable image", id="image-jpeg-header-only"),
    bad(
        {**VIDEO, "image": "half.jpg"},
        "image",
        "",
        "is not a readable image",
        id="image-truncated-jpeg",
    ),
    bad(
        {**VIDEO, "num_frames": 1, "image": "good.png"}, "image", "image conditioning needs a video", id="i2i"
    ),
    # Video-to-video: the clip (decoded in full, as load_video will) and its knobs.
    bad({**VIDEO, "video": "missing.mp4"}, "video", "video file not found", id="video-missing"),
    bad({**VIDEO, "video": "dangling.mp4"}, "video", "", "is a symbolic link to", id="video-dangling-link"),
    bad({**VIDEO, "video": "half.mp4"}, "video", "", "is not a readable video", id="video-truncated-mp4"),
    bad({**VIDEO, "video": "empty.mp4"}, "video", "", "is not a readable video", id="video-empty-file"),
    bad({**VIDEO, "video": "text.png"}, "video", "", "is not a readable video", id="video-not-video"),
    bad({**VIDEO, "video": ""}, "video", "must be a path to a video file", id="video-empty-path"),
    bad({**VIDEO, "video": 3}, "video", "must be a string, got 3", id="video-int"),
    bad(
        {**VIDEO, "video": "clip.mp4", "image": "good.png"},
        "video",
        "give either image (image-to-video) or video (video-to-video), not both",
        id="video-and-image",
    ),
    bad(
        {**VIDEO, "num_frames": 1, "video": "clip.mp4"},
        "video",
        "video conditioning needs a video output",
        id="video-for-image",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_frames": [0, 3]},
        "condition_frames",
        "index 3 is outside the latent timeline: 9 frames are 3 latent frames",
        id="condition-frames-outside",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_frames": []},
        "condition_frames",
        "must name at least one",
        id="condition-frames-empty",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_frames": [-1]},
        "condition_frames",
        "indexes must be >= 0",
        id="condition-frames-negative",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_frames": "0,1"},
        "condition_frames",
        "must be a list of latent frame indexes",
        id="condition-frames-string",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_frames": [0, True]},
        "condition_frames",
        "must be a list of latent frame indexes",
        id="condition-frames-bool",
    ),
    bad(
        {**VIDEO, "condition_frames": [0]},
        "condition_frames",
        "is only used with video",
        id="frames-no-video",
    ),
    bad(
        {**VIDEO, "condition_video_keep": "last"},
        "condition_video_keep",
        "is only used with video",
        id="keep-no-video",
    ),
    bad(
        {**VIDEO, "video": "clip.mp4", "condition_video_keep": "middle"},
        "condition_video_keep",
        'must be "first" or "last"',
        id="keep-bad",
    ),
    bad({**VIDEO, "system_prompt": "yes"}, "system_prompt", "must be true or false", id="system-prompt-str"),
    bad({**VIDEO, "sound": 1}, "sound", "must be true or false, got 1", id="sound-int"),
    bad({**VIDEO, "num_frames": 1, "sound": True}, "sound", "joint audio needs a video", id="sound-image"),
    case(  # the same clip is accepted on its own: the rows above fail for their own reason, not the clip
        jsonl(
            VALID, {**VIDEO, "video": "clip.mp4", "condition_frames": [0, 2]}, {"prompt": "x", "seed": True}
        ),
        "line 3, field 'seed'",
        absent=("line 2",),
        id="video-valid-accepted",
    ),
    # Action modes: the object, its conditioning, and the actions file.
    bad({"prompt": "x", "action": "policy"}, "action", "must be an object", id="action-not-object"),
    bad(act(mode="dream"), "action.mode", "must be one of forward_dynamics", id="action-mode-unknown"),
    bad(act(mode=None), "action.mode", "missing", id="action-mode-missing"),
    bad(
        act(domain="mars_rover"),
        "action.domain",
        "unknown domain",
        "valid domains: agibot",
        id="action-domain",
    ),
    bad(act(domain="libero"), "action.domain", "unknown domain 'libero'", id="action-domain-no-width"),
    bad(
        act(resolution_tier=360),
        "action.resolution_tier",
        "must be one of 256, 480, 704, 720",
        id="action-tier",
    ),
    bad(act(viewpoint="drone"), "action.viewpoint", "must be one of ego_view", id="action-viewpoint"),
    bad(
        act(chunk_size=6),
        "action.chunk_size",
        "6 is not a multiple of 4 (nearest valid: 4 or 8)",
        id="chunk-4k",
    ),
    bad(act(chunk_size=0), "action.chunk_size", "must be >= 4", id="chunk-zero"),
    bad(act(chunk_size=4096), "action.chunk_size", "must be >= 4 and <= 1023", id="chunk-too-big"),
    bad(act(chunk_size=True), "action.chunk_size", "must be an integer", id="chunk-bool"),
    bad(act(extra=1), "action.extra", "unknown key", id="action-unknown-key"),
    bad(act(size="32x32"), "size", "set by action", id="action-with-size"),
    bad(act(num_frames=9), "num_frames", "set by action", id="action-with-frames"),
    bad(act(sound="yes"), "sound", "must be true or false", id="action-sound-str"),
    bad(act(image=None), "action", "needs a conditioning image or video", id="action-no-conditioning"),
    bad(
        act(video="clip.mp4"),
        "video",
        "give the action's conditioning as image or video, not both",
        id="action-image-and-video",
    ),
    bad(
        act(mode="inverse_dynamics", actions=None),
        "image",
        "inverse_dynamics",
        "needs a video",
        id="inverse-image",
    ),
    bad(act(actions=None), "action.actions", "forward_dynamics needs actions", id="fd-no-actions"),
    bad(
        act(mode="policy"), "action.actions", "only forward_dynamics takes actions", id="policy-with-actions"
    ),
    bad(
        act(actions="wide.npy"),
        "action.actions",
        "rows are 9 wide; fractal actions are 10 wide",
        id="npy-width",
    ),
    bad(act(actions="ints.npy"), "action.actions", "", "dtype <U1 is not a real number", id="npy-dtype"),
    bad(act(actions="nan.json"), "action.actions", "contains NaN or infinity", id="json-nan"),
    bad(act(actions="half.npy"), "action.actions", "", "is not a readable actions file", id="npy-truncated"),
    bad(act(actions="a.csv"), "action.actions", "actions file not found", id="actions-missing"),
    bad(act(actions="good.png"), "action.actions", "", "must be .npy or .json", id="actions-wrong-type"),
    bad(
        act(actions=[[1.0] * 10, [1.0] * 9]),
        "action.actions",
        "must be a [T, D] list of lists of numbers",
        id="actions-ragged",
    ),
    bad(act(actions=[]), "action.actions", "must have shape [T, D] with T >= 1", id="actions-empty"),
    bad(act(actions=[[True] * 10]), "action.actions", "must be a [T, D] list of lists", id="actions-bool"),
    bad(
        act(image="gray.png"),
        "image",
        "",
        "has 'L' pixels; action conditioning needs RGB",
        id="action-gray-image",
    ),
    bad(
        act(image=None, video="half.mp4"), "video", "", "is not a readable video", id="action-truncated-video"
    ),
    bad(
        act(action={"mode": "policy", "chunk_size": 16, "domain": "fractal", "resolution_tier": 720}),
        "action",
        "1104x832 x 17 frames is 4,550 vision tokens, over the per-request bound of 1,000",
        args=("--max-vision-tokens", "1000"),
        id="action-over-budget",
    ),
    case(  # a valid action line passes: line 3 alone stops the job
        jsonl(VALID, act(), {"prompt": "x", "seed": True}),
        "line 3, field 'seed'",
        absent=("line 2",),
        id="action-valid-accepted",
    ),
    # Several problems: every one is listed, not only the first.
    case(
        jsonl(VALID, {"prompt": "", "seed": True}, {"prompt": "x", "id": "a/b"}, "not json"),
        "line 2, field 'prompt'",
        "line 2, field 'seed'",
        "line 3, field 'id'",
        "line 4: not valid JSON",
        id="many-problems",
    ),
    case(
        jsonl(VALID, {"prompt": "x", "seed": True}, {**VALID, "id": "long", "prompt": LONG}),
        "line 2, field 'seed'",
        "line 3, field 'prompt'",
        id="many-problems-with-token-limit",
    ),
    # Safety models an offline job does not have.
    bad(
        {"prompt": "x", "extra_params": {"guardrails": True}}, "extra_params.guardrails", "", id="guardrails"
    ),
]


def _files(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


@pytest.mark.parametrize(("content", "expected", "args", "absent"), CASES)
def test_hostile_file_exits_2_naming_the_line_and_writes_nothing(
    tmp_path: Path,
    tiny_ckpt: Path,
    tiny_av_ckpt: Path,
    content: bytes,
    expected: tuple[str, ...],
    args: tuple[str, ...],
    absent: tuple[str, ...],
) -> None:
    # Action lines are checked against a checkpoint that has action_gen: on one without it, that one error
    # is all a line gets (its own test below).
    model = tiny_av_ckpt if b'"action"' in content else tiny_ckpt
    png, jpeg = _image("PNG"), _image("JPEG")
    (tmp_path / "good.png").write_bytes(png)
    (tmp_path / "half.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "head.jpg").write_bytes(jpeg[:300])
    (tmp_path / "half.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "text.png").write_text("this is text, not a PNG\n")
    clip = CLIP.read_bytes()
    (tmp_path / "clip.mp4").write_bytes(clip)
    (tmp_path / "half.mp4").write_bytes(clip[: len(clip) // 2])
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "dangling.mp4").symlink_to(tmp_path / "gone.mp4")
    np.save(tmp_path / "wide.npy", np.zeros((4, 9), dtype=np.float32))
    np.save(tmp_path / "ints.npy", np.array([["a"] * 10]))
    npy = (tmp_path / "wide.npy").read_bytes()
    (tmp_path / "half.npy").write_bytes(npy[: len(npy) // 2])
    (tmp_path / "nan.json").write_text("[[NaN, 0, 0, 0, 0, 0, 0, 0, 0, 0]]")
    Image.new("L", (64, 48)).save(tmp_path / "gray.png")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    before = _files(tmp_path)
    out = tmp_path / "out"
    result = invoke("run", prompts, "--model", model, "--out", out, "--no-progress", *args)
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.output, result.output
    for text in absent:
        assert text not in result.output, result.output
    assert _files(tmp_path) - {out} == before  # `run` may create --out while checking it; nothing in it


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_out_that_cannot_be_created_exits_2(tmp_path: Path, tiny_ckpt: Path, where: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file\n")
    out = blocker / "out" if where == "under-a-file" else blocker
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(jsonl(VALID))
    result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress")
    assert result.exit_code == 2, result.output
    where = "is a file" if out == blocker else f"cannot be made: {blocker} is a file"
    assert f"error: --out {out}: {where}, not a folder\n" in result.output
    assert blocker.read_text() == "a regular file\n"


def test_read_only_out_exits_2(tmp_path: Path, tiny_ckpt: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(jsonl(VALID))

    def refused(out: Path) -> None:
        result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress")
        assert result.exit_code == 2, result.output
        assert f"--out {out}: cannot write there" in result.output
        assert list(out.iterdir()) == []

    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o500)
    try:
        if not os.access(out, os.W_OK):
            refused(out)
            return
    finally:
        out.chmod(0o700)
    # Root (as CI runs) writes through a 0o500 folder: a filesystem mounted read-only stops it.
    with tmpfs(tmp_path / "ro", "1m") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        refused(mount)


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({**VIDEO, "sound": True}, "sound", "this checkpoint cannot generate sound"),
        (act(), "action", "this checkpoint cannot run action modes: its transformer has no action_gen"),
    ],
    ids=["sound", "action"],
)
def test_mode_on_a_checkpoint_without_it_exits_2(
    tmp_path: Path, tiny_ckpt: Path, row: dict, field: str, message: str
) -> None:
    """The checkpoint's modes are in the limits (request_modes.checkpoint_modes): a sound or action request
    on the default tiny model (it has neither) stops the job before anything is loaded."""
    (tmp_path / "good.png").write_bytes(_image("PNG"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(jsonl(VALID, row))
    result = invoke("run", prompts, "--model", tiny_ckpt, "--out", tmp_path / "out", "--no-progress")
    assert result.exit_code == 2, result.output
    assert f"line 2, field '{field}': {message}" in result.output
