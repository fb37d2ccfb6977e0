"""JSONL request validation: exact line numbers, fields and message fragments; no torch involved."""

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess

import pytest
from PIL import Image

from cosmos3_batch.requests.actions import ActionSpec
from cosmos3_batch.requests.chain import DEFAULT_TEMPLATE, CaptionSpec, UpsampleSpec
from cosmos3_batch.requests.parse import (
    DEFAULT_FPS,
    DEFAULT_GUIDANCE,
    ModelLimits,
    Request,
    RequestError,
    RequestFileError,
    derive_seed,
    load_requests,
    parse_lines,
)
from cosmos3_batch.requests.reason import ReasonSpec
from cosmos3_batch.requests.transfer import TransferSpec
from tests.dist.jobs import JOB_PYTHON

DROP = object()  # marks a key to remove from the base request in a table row


def line_of(**fields: object) -> bytes:
    """One JSONL line: a minimal valid request with `fields` laid over it (DROP removes a key)."""
    obj = {"prompt": "a red fox"} | fields
    return json.dumps({key: value for key, value in obj.items() if value is not DROP}).encode()


LIMITS = ModelLimits()


def parse(*lines: bytes | str, base_dir: str | None = None, limits: ModelLimits = LIMITS):
    raw = [line if isinstance(line, bytes) else line.encode() for line in lines]
    return parse_lines(raw, base_dir=base_dir, limits=limits)


def only_error(*lines: bytes | str, base_dir: str | None = None) -> RequestError:
    requests, errors = parse(*lines, base_dir=base_dir)
    assert requests == []
    assert len(errors) == 1, [str(error) for error in errors]
    return errors[0]


def write_png(path, size=(8, 8)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)
    return str(path)


# ----------------------------------------------------------------------------- good files


def test_full_request_every_field_and_defaults(tmp_path):
    image = write_png(tmp_path / "imgs" / "cond.png")
    full = {
        "id": "fox-01",
        "prompt": "a red fox in snow",
        "negative_prompt": "blurry",
        "size": "832x480",
        "num_frames": 93,
        "fps": 16,
        "num_inference_steps": 20,
        "guidance_scale": 7,
        "seed": 42,
        "max_sequence_length": 512,
        "flow_shift": 5,
        "image": "imgs/cond.png",
        "extra_params": {"use_resolution_template": False, "use_duration_template": False},
    }
    lines = ["# header", json.dumps(full), "", '{"prompt": "image", "num_frames": 1}', '{"prompt": "video"}']
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")

    requests, errors = load_requests(str(path))

    assert errors == []
    assert [(r.id, r.line, r.kind) for r in requests] == [
        ("fox-01", 2, "i2v"),
        ("line000004", 4, "t2i"),
        ("line000005", 5, "t2v"),
    ]
    assert requests[0].resolved() == {
        "id": "fox-01",
        "prompt": "a red fox in snow",
        "negative_prompt": "blurry",
        "width": 832,
        "height": 480,
        "num_frames": 93,
        "fps": 16.0,
        "num_inference_steps": 20,
        "guidance_scale": 7.0,
        "seed": 42,
        "max_sequence_length": 512,
        "flow_shift": 5.0,
        "image": image,
        "use_resolution_template": False,
        "use_duration_template": False,
    }
    assert os.path.isabs(requests[0].image)
    for name in ("fps", "guidance_scale", "flow_shift"):
        assert type(getattr(requests[0], name)) is float
    t2i, t2v = requests[1], requests[2]
    assert (t2i.width, t2i.height, t2i.num_frames, t2i.num_inference_steps) == (1024, 1024, 1, 50)
    assert (t2v.width, t2v.height, t2v.num_frames, t2v.num_inference_steps) == (1280, 720, 189, 35)
    for request in (t2i, t2v):
        assert (request.fps, request.guidance_scale) == (DEFAULT_FPS, DEFAULT_GUIDANCE) == (24.0, 6.0)
        assert (request.negative_prompt, request.max_sequence_length) == (None, None)
        assert (request.flow_shift, request.image) == (None, None)
        assert request.use_resolution_template is True and request.use_duration_template is True
        assert request.seed == derive_seed(request.id)
    json.dumps(requests[0].resolved())  # JSON-serialisable, for the sidecar


def test_width_height_keys_and_nulls_mean_default():
    line = line_of(width=832, height=480, seed=None, negative_prompt=None, flow_shift=None, extra_params=None)
    (request,), errors = parse(line)
    assert errors == []
    assert (request.width, request.height) == (832, 480)
    assert (request.negative_prompt, request.flow_shift) == (None, None)
    assert request.seed == derive_seed("line000001")


def test_guardrails_false_and_single_template_flag_accepted():
    (request,), errors = parse(line_of(extra_params={"guardrails": False, "use_duration_template": False}))
    assert errors == []
    assert (request.use_resolution_template, request.use_duration_template) == (True, False)


def test_blank_and_comment_lines_skipped_but_counted():
    lines = ["", "   ", "# a comment", "   # indented comment", line_of(id="a"), "\t", line_of(prompt="")]
    requests, errors = parse(*lines)
    assert [(r.id, r.line) for r in requests] == [("a", 5)]
    assert [(e.line, e.field) for e in errors] == [(7, "prompt")]


def test_crlf_and_byte_order_mark():
    data = b"\xef\xbb\xbf" + line_of(id="a") + b"\r\n" + line_of(id="b") + b"\r\n"
    requests, errors = parse_lines(data.split(b"\n"))
    assert errors == []
    assert [(r.id, r.line) for r in requests] == [("a", 1), ("b", 2)]


def test_non_default_limits_check_defaults_too():
    limits = ModelLimits(spatial_factor=32, temporal_factor=8)
    requests, errors = parse(line_of(num_frames=17, size="64x32"), line_of(id="d"), limits=limits)
    assert [r.num_frames for r in requests] == [17]
    assert [(e.line, e.field, e.message) for e in errors] == [
        (
            2,
            "num_frames",
            "default num_frames 189 cannot be represented: use 185 or 193 (video frame counts are 8k+1)",
        ),
        (2, "size", "default size 1280x720: height 720 is not a multiple of 32 (nearest valid: 704 or 736)"),
    ]


# ----------------------------------------------------------------------------- one bad value per row

BAD_VALUES = [
    # (fields laid over a valid request, field at fault, message fragment)
    ({"prompt": DROP}, "prompt", "missing: every request needs a non-empty prompt"),
    ({"prompt": None}, "prompt", "missing"),
    ({"prompt": "  \t"}, "prompt", "must not be empty or whitespace only"),
    ({"prompt": 5}, "prompt", "must be a string, got 5"),
    ({"prompt": ["a"]}, "prompt", "must be a string, got an array"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt", "unpaired surrogate"),
    ({"negative_prompt": 3}, "negative_prompt", "must be a string, got 3"),
    ({"size": "832X480"}, "size", 'must be "WIDTHxHEIGHT" with a lowercase x, e.g. "832x480"'),
    ({"size": "832x480 "}, "size", 'must be "WIDTHxHEIGHT"'),
    ({"size": 832}, "size", 'must be "WIDTHxHEIGHT" with a lowercase x, e.g. "832x480", got 832'),
    ({"size": "830x480"}, "size", "830x480: width 830 is not a multiple of 16 (nearest valid: 816 or 832)"),
    ({"size": "832x470"}, "size", "832x470: height 470 is not a multiple of 16 (nearest valid: 464 or 480)"),
    ({"size": "8x480"}, "size", "8x480: width 8 is not a multiple of 16 (nearest valid: 16)"),
    ({"size": "0x480"}, "size", "0x480: width must be positive, got 0"),
    ({"size": "832x4112"}, "size", "832x4112: height 4112 exceeds the maximum of 4096"),
    ({"size": "832x480", "width": 832}, "size", "give either size or width and height, not both"),
    ({"width": 832}, "width", "width needs height too"),
    ({"height": 480}, "height", "height needs width too"),
    ({"width": 830, "height": 480}, "width", "width 830 is not a multiple of 16 (nearest valid: 816 or 832)"),
    ({"width": 832, "height": -16}, "height", "height must be positive, got -16"),
    ({"width": 832.0, "height": 480}, "width", "must be an integer, got 832.0"),
    ({"width": "832", "height": 480}, "width", "must be an integer, got a string ('832')"),
    ({"num_frames": 10}, "num_frames", "num_frames 10 cannot be represented: use 9 or 13"),
    ({"num_frames": 3}, "num_frames", "num_frames 3 cannot be represented: use 5 ("),
    ({"num_frames": 1023}, "num_frames", "num_frames 1023 cannot be represented: use 1021 ("),
    ({"num_frames": 0}, "num_frames", "num_frames must be >= 1, got 0"),
    ({"num_frames": 1025}, "num_frames", "num_frames 1025 exceeds the maximum of 1024"),
    ({"num_frames": 9.0}, "num_frames", "must be an integer, got 9.0"),
    ({"fps": 0}, "fps", "must be > 0 and <= 240, got 0.0"),
    ({"fps": 240.5}, "fps", "must be > 0 and <= 240, got 240.5"),
    ({"fps": "24"}, "fps", "must be a number, got a string ('24')"),
    ({"num_inference_steps": 0}, "num_inference_steps", "must be >= 1 and <= 1000, got 0"),
    ({"num_inference_steps": 1001}, "num_inference_steps", "must be >= 1 and <= 1000, got 1001"),
    ({"num_inference_steps": 35.0}, "num_inference_steps", "must be an integer, got 35.0"),
    ({"guidance_scale": -0.5}, "guidance_scale", "must be >= 0 and <= 100, got -0.5"),
    ({"guidance_scale": 101}, "guidance_scale", "must be >= 0 and <= 100, got 101.0"),
    ({"flow_shift": 0}, "flow_shift", "must be > 0 and <= 100, got 0.0"),
    ({"flow_shift": 100.01}, "flow_shift", "must be > 0 and <= 100, got 100.01"),
    ({"flow_shift": "5"}, "flow_shift", "must be a number, got a string ('5')"),
    ({"seed": -1}, "seed", "must be >= 0 and <= 9223372036854775807, got -1"),
    ({"seed": 2**63}, "seed", "must be >= 0 and <= 9223372036854775807, got 9223372036854775808"),
    ({"seed": 1.5}, "seed", "must be an integer, got 1.5"),
    ({"max_sequence_length": 0}, "max_sequence_length", "must be >= 1 and <= 1000000, got 0"),
    ({"max_sequence_length": 1_000_001}, "max_sequence_length", "must be >= 1 and <= 1000000, got 1000001"),
    ({"image": 5}, "image", "must be a string, got 5"),
    ({"image": ""}, "image", "must be a path to an image file, got an empty string"),
    ({"extra_params": []}, "extra_params", "must be an object, got an array"),
    ({"extra_params": True}, "extra_params", "must be an object, got a boolean (true)"),
    ({"extra_params": {"guardrail": False}}, "extra_params.guardrail", "unknown key; allowed: use_res"),
    ({"extra_params": {"use_resolution_template": 1}}, "extra_params.use_resolution_template", "got 1"),
    ({"extra_params": {"use_duration_template": "no"}}, "extra_params.use_duration_template", "or false"),
    ({"extra_params": {"guardrails": None}}, "extra_params.guardrails", "must be true or false, got null"),
    ({"id": 5}, "id", "must be a string, got 5"),
    ({"id": "summary"}, "id", "'summary' is reserved"),
    ({"id": "Summary"}, "id", "'Summary' is reserved"),
    ({"sizes": "832x480"}, "sizes", "unknown key 'sizes' (did you mean 'sizes' -> 'size'?)"),
]


@pytest.mark.parametrize(("fields", "field", "fragment"), BAD_VALUES)
def test_bad_value(fields, field, fragment):
    error = only_error("# comment", line_of(**fields))
    assert (error.line, error.field) == (2, field)
    assert fragment in error.message


def test_guardrails_true_rejected_in_a_job_without_them():
    """A request may only restate the job's setting: it never runs without the checks it asked for."""
    error = only_error(line_of(extra_params={"guardrails": True}))
    assert (error.line, error.field) == (1, "extra_params.guardrails")
    for fragment in ("this job runs without guardrails", "--guardrails", "never run without the checks"):
        assert fragment in error.message


def test_guardrails_in_a_guarded_job_true_accepted_false_rejected():
    guarded = dataclasses.replace(LIMITS, guardrails=True)
    (request,), errors = parse(line_of(extra_params={"guardrails": True}), limits=guarded)
    assert errors == [] and request.prompt == "a red fox"
    (request,), errors = parse(line_of(), limits=guarded)
    assert errors == []
    _, (error,) = parse(line_of(extra_params={"guardrails": False}), limits=guarded)
    assert (error.line, error.field) == (1, "extra_params.guardrails")
    assert "one request cannot turn them off" in error.message and "--no-guardrails" in error.message


NUMBER_FIELDS = [
    ("width", "an integer"),
    ("height", "an integer"),
    ("num_frames", "an integer"),
    ("num_inference_steps", "an integer"),
    ("seed", "an integer"),
    ("max_sequence_length", "an integer"),
    ("fps", "a number"),
    ("guidance_scale", "a number"),
    ("flow_shift", "a number"),
]


@pytest.mark.parametrize(("key", "kind"), NUMBER_FIELDS)
@pytest.mark.parametrize("flag", [True, False])
def test_bool_is_not_a_number(key, kind, flag):
    fields = {"width": 832, "height": 480} | {key: flag}
    error = only_error(line_of(**fields))
    assert (error.line, error.field) == (1, key)
    assert error.message == f"must be {kind}, got a boolean ({json.dumps(flag)})"


def test_one_line_reports_every_problem():
    line = line_of(prompt="", size="830x470", fps=0, seed=-1, foo=1, bar=2)
    _, errors = parse(line)
    assert [(e.line, e.field) for e in errors] == [
        (1, "bar"),
        (1, "prompt"),
        (1, "size"),
        (1, "size"),
        (1, "fps"),
        (1, "seed"),
    ]
    assert errors[0].message.startswith("unknown keys 'bar', 'foo'; allowed keys: id, prompt,")


# ----------------------------------------------------------------------------- whole-line problems

LINE_PROBLEMS = [
    ('{"prompt": "a",}', None, "not valid JSON: Expecting property name enclosed in double quotes"),
    ('{"prompt": "a"} trailing', None, "not valid JSON: Extra data (column 17)"),
    ("[1, 2]", None, "each line must be a JSON object, got an array"),
    ('"just a string"', None, "each line must be a JSON object, got a string ('just a string')"),
    ("NaN", None, "each line must be a JSON object, got NaN (JSON numbers must be finite)"),
    ('{"prompt": "a", "fps": NaN}', "fps", "must be a number, got NaN (JSON numbers must be finite)"),
    ('{"prompt": "a", "guidance_scale": Infinity}', "guidance_scale", "got Infinity (JSON numbers must be"),
    ('{"prompt": "a", "seed": -Infinity}', "seed", "must be an integer, got -Infinity (JSON numbers must be"),
    ('{"prompt": "a", "flow_shift": 1e999}', "flow_shift", "must be finite, got inf"),
    ('{"prompt": NaN}', "prompt", "must be a string, got NaN"),
    ('{"prompt": "a", "seed": 1, "seed": 2}', "seed", "key appears more than once"),
    (
        '{"prompt":"a","extra_params":{"guardrails":false,"guardrails":false}}',
        "extra_params.guardrails",
        "once",
    ),
    ('{"prompt": "a", "seed": 1' + "0" * 5000 + "}", None, "not valid JSON: a number has too many digits"),
    ("[" * 100_000 + "]" * 100_000, None, "not valid JSON: nested too deeply"),
]


@pytest.mark.parametrize(("text", "field", "fragment"), LINE_PROBLEMS)
def test_line_problem(text, field, fragment):
    error = only_error("", text)
    assert (error.line, error.field) == (2, field)
    assert fragment in error.message


def test_non_utf8_line():
    requests, errors = parse_lines([line_of(id="ok"), b'{"prompt": "caf\xe9"}', line_of(id="ok2")])
    assert [r.id for r in requests] == ["ok", "ok2"]
    assert errors == [RequestError(2, None, "not valid UTF-8 (byte 0xe9 at offset 15)")]


# ----------------------------------------------------------------------------- ids


@pytest.mark.parametrize(
    "bad_id",
    ["../x", "a/b", "a\\b", ".hidden", "a..b", "..", "a\x00b", "x" * 129, "", "a b", "café", "a\nb", "/abs"],
)
def test_hostile_id_rejected(bad_id):
    error = only_error(line_of(id=bad_id))
    assert (error.line, error.field) == (1, "id")
    assert "is not a safe file name" in error.message
    assert "\n" not in error.message and "\x00" not in error.message  # shown escaped, never raw


@pytest.mark.parametrize("good_id", ["a", "a.b", "A-Z_0.9", "x" * 128, "summary2", "v1.2-final_"])
def test_safe_id_accepted(good_id):
    (request,), errors = parse(line_of(id=good_id))
    assert errors == []
    assert request.id == good_id


def test_duplicate_ids_name_the_first_line():
    lines = [line_of(id="a"), line_of(id="b"), "# c", line_of(id="a"), line_of(id="line000006"), line_of()]
    requests, errors = parse(*lines)
    assert [(r.id, r.line) for r in requests] == [("a", 1), ("b", 2), ("line000006", 5)]
    assert [(e.line, e.field, e.message) for e in errors] == [
        (4, "id", "duplicate id 'a': already used on line 1"),
        (6, "id", "duplicate id 'line000006' (derived from the line number): already used on line 5"),
    ]


def test_duplicate_of_an_invalid_line_is_still_reported():
    _, errors = parse(line_of(id="a", fps=0), line_of(id="a"))
    assert [(e.line, e.field) for e in errors] == [(1, "fps"), (2, "id")]


# ----------------------------------------------------------------------------- images


def test_image_problems(tmp_path):
    write_png(tmp_path / "ok.png")
    (tmp_path / "fake.png").write_bytes(b"not an image at all")
    (tmp_path / "folder").mkdir()
    lines = [
        line_of(image="ok.png"),
        line_of(image="missing.png"),
        line_of(image="fake.png"),
        line_of(image="folder"),
        line_of(image="ok.png", num_frames=1),
        line_of(image=str(tmp_path / "ok.png"), id="abs"),
    ]
    requests, errors = parse(*lines, base_dir=str(tmp_path))
    assert [(r.line, r.image, r.kind) for r in requests] == [
        (1, str(tmp_path / "ok.png"), "i2v"),
        (6, str(tmp_path / "ok.png"), "i2v"),
    ]
    assert [(e.line, e.field) for e in errors] == [(2, "image"), (3, "image"), (4, "image"), (5, "image")]
    assert errors[0].message == f"image file not found: {tmp_path / 'missing.png'}"
    assert errors[1].message.startswith(f"{tmp_path / 'fake.png'} is not a readable image (")
    assert errors[2].message == f"image file not found: {tmp_path / 'folder'}"
    assert errors[3].message == "image conditioning needs a video (num_frames > 1), but num_frames is 1"


def test_relative_image_without_base_dir_uses_cwd(tmp_path, monkeypatch):
    write_png(tmp_path / "ok.png")
    monkeypatch.chdir(tmp_path)
    (request,), errors = parse(line_of(image="ok.png"))
    assert errors == []
    assert request.image == str(tmp_path / "ok.png")


# ----------------------------------------------------------------------------- files


def write_lines(path, *lines: bytes | str) -> str:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return str(path)


def test_several_bad_lines_in_one_error(tmp_path):
    path = write_lines(
        tmp_path / "r.jsonl",
        line_of(id="good"),
        line_of(size="830x480"),
        "",
        "not json",
        line_of(num_frames=10, fps=True),
        line_of(id="good"),
    )
    with pytest.raises(RequestFileError) as info:
        load_requests(path)
    assert info.value.source == path
    assert [(e.line, e.field) for e in info.value.errors] == [
        (2, "size"),
        (4, None),
        (5, "num_frames"),
        (5, "fps"),
        (6, "id"),
    ]
    assert str(info.value).splitlines() == [f"{path}: {error}" for error in info.value.errors]
    assert str(info.value).splitlines()[0] == (
        f"{path}: line 2, field 'size': 830x480: width 830 is not a multiple of 16 "
        "(nearest valid: 816 or 832)"
    )


def test_skip_invalid_returns_valid_requests_and_errors(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", line_of(id="a"), line_of(fps=-1), line_of(id="c", num_frames=1))
    requests, errors = load_requests(path, skip_invalid=True)
    assert [(r.id, r.line) for r in requests] == [("a", 1), ("c", 3)]
    assert [(e.line, e.field) for e in errors] == [(2, "fps")]


@pytest.mark.parametrize("content", [b"", b"\n\n", b"# only a comment\n   \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    with pytest.raises(RequestFileError) as info:
        load_requests(str(path))
    assert info.value.errors == [RequestError(0, None, "no requests in file")]
    assert str(info.value) == f"{path}: no requests in file"
    with pytest.raises(RequestFileError) as skipping:  # a whole input is never an invalid request to skip
        load_requests(str(path), skip_invalid=True)
    assert str(skipping.value) == f"{path}: no requests in file"


@pytest.mark.parametrize("name", ["missing.jsonl", "."])
def test_unreadable_file(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(RequestFileError) as info:
        load_requests(path)
    ((error),) = info.value.errors
    assert (error.line, error.field) == (0, None)
    assert error.message.startswith("cannot read request file: ")
    assert str(info.value).startswith(f"{path}: cannot read request file: ")


def test_request_file_error_pickles():
    error = RequestFileError("r.jsonl", [RequestError(3, "fps", "bad")])
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.source, copy.errors) == ("r.jsonl", error.errors)
    assert str(copy) == "r.jsonl: line 3, field 'fps': bad"


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (RequestError(3, "size", "830x480: bad"), "line 3, field 'size': 830x480: bad"),
        (RequestError(4, None, "not valid JSON"), "line 4: not valid JSON"),
        (RequestError(0, None, "no requests in file"), "no requests in file"),
        (RequestError(5, "a\nb", "unknown"), "line 5, field 'a\\nb': unknown"),
    ],
)
def test_request_error_str(error, text):
    assert str(error) == text


# ----------------------------------------------------------------------------- seeds and hashes


def test_derive_seed_is_deterministic_and_per_id():
    expected = int.from_bytes(hashlib.sha256(b"fox-01").digest()[:8], "big") & (2**63 - 1)
    assert derive_seed("fox-01") == derive_seed("fox-01") == expected
    seeds = {derive_seed(f"req{i}") for i in range(1000)}
    assert len(seeds) == 1000
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_seed_depends_on_id_not_line():
    (first,), _ = parse(line_of(id="x"))
    (moved,), _ = parse("", "# c", line_of(id="x"))
    assert first.seed == moved.seed == derive_seed("x")
    assert moved.line == 3


def base_request() -> Request:
    (request,), errors = parse(line_of(id="h", negative_prompt="n", max_sequence_length=256, flow_shift=3.0))
    assert errors == []
    return request


def test_content_hash_equal_for_equal_requests():
    request = base_request()
    (moved,), _ = parse("", line_of(id="h", negative_prompt="n", max_sequence_length=256, flow_shift=3))
    assert moved.line != request.line
    assert moved.content_hash() == request.content_hash()
    elsewhere = dataclasses.replace(request, source="other.parquet", unit="row")  # another file, same request
    assert elsewhere.content_hash() == request.content_hash()
    assert len(request.content_hash()) == 64
    canonical = json.dumps(request.resolved(), sort_keys=True, separators=(",", ":")).encode()
    assert request.content_hash() == hashlib.sha256(canonical).hexdigest()


CHANGES = {
    "id": "h2",
    "prompt": "other",
    "negative_prompt": None,
    "width": 1296,
    "height": 736,
    "num_frames": 185,
    "fps": 24.5,
    "num_inference_steps": 36,
    "guidance_scale": 6.5,
    "seed": 7,
    "max_sequence_length": 257,
    "flow_shift": None,
    "image": "/x.png",
    "use_resolution_template": False,
    "use_duration_template": False,
    "video": "/x.mp4",
    "condition_frames": (0,),
    "condition_video_keep": "last",
    "system_prompt": False,
    "sound": True,
    "action": ActionSpec("policy", 8, "fractal", 256, "ego_view"),
    "transfer": TransferSpec((("edge", "/e.mp4"),), (9,), 1.0, None, None, 9, 1, 9, 1),
    "reason": ReasonSpec(max_new_tokens=8),
    "upsample": UpsampleSpec(DEFAULT_TEMPLATE),
    "captions": CaptionSpec(caption="Say what you see."),
}


def test_changes_cover_every_field_but_line():
    # line, source, unit and an NVIDIA sample's name say where a request came from: moving it between files
    # keeps its record.
    # prompt_original and upsampled are set on the request that generates from its upsampled prompt: the
    # same request (test_upsampled_request_keeps_its_hash).
    where = {"line", "source", "unit", "sample", "prompt_original", "upsampled"}
    assert set(CHANGES) == {f.name for f in dataclasses.fields(Request)} - where


def test_upsampled_request_keeps_its_hash():
    request = dataclasses.replace(base_request(), upsample=UpsampleSpec(DEFAULT_TEMPLATE))
    upsampled = dataclasses.replace(
        request, prompt="a longer prompt", prompt_original=request.prompt, upsampled={"reply": "x"}
    )
    assert upsampled.content_hash() == request.content_hash()
    assert upsampled.resolved() == request.resolved()


@pytest.mark.parametrize(("name", "value"), CHANGES.items())
def test_content_hash_differs_when_a_field_differs(name, value):
    request = base_request()
    changed = dataclasses.replace(request, **{name: value})
    assert getattr(changed, name) != getattr(request, name)
    assert changed.content_hash() != request.content_hash()


def test_kind():
    request = base_request()
    assert request.kind == "t2v"
    assert dataclasses.replace(request, num_frames=1).kind == "t2i"
    assert dataclasses.replace(request, image="/x.png").kind == "i2v"
    assert dataclasses.replace(request, video="/x.mp4").kind == "v2v"


def test_unused_mode_fields_leave_the_record_and_hash_as_they_were():
    # Outputs written before the mode fields existed must stay complete on resume: same record, same hash.
    request = base_request()
    mode_fields = {"video", "condition_frames", "condition_video_keep", "system_prompt"}
    assert not mode_fields & set(request.resolved())
    with_system = dataclasses.replace(request, system_prompt=True)
    assert with_system.resolved()["system_prompt"] is True


def test_module_does_not_import_torch():
    heavy = "{'torch', 'diffusers', 'transformers'}"
    code = (
        f"import cosmos3_batch.requests.parse, sys; assert not {heavy} & set(sys.modules), sys.modules.keys()"
    )
    subprocess.run([JOB_PYTHON, "-c", code], check=True)


def test_sound_on_a_checkpoint_without_it_is_named():
    line = line_of(num_frames=9, size="32x32", sound=True)
    (ok,), errors = parse(line, limits=ModelLimits(sound=True))
    assert errors == [] and ok.sound and ok.kind == "t2v+sound"
    _, errors = parse(line, limits=ModelLimits(sound=False))
    assert [(e.line, e.field) for e in errors] == [(1, "sound")]
    assert "has no sound_tokenizer" in errors[0].message


def test_checkpoint_modes_read_from_configs():
    from cosmos3_batch.requests.modes import checkpoint_modes

    with_tokenizer = {"sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"]}
    assert checkpoint_modes(with_tokenizer, {"sound_gen": True})["sound"] is True
    assert checkpoint_modes(with_tokenizer, {})["sound"] is False
    assert checkpoint_modes({"sound_tokenizer": [None, None]}, {"sound_gen": True})["sound"] is False
    actions = checkpoint_modes({}, {"action_gen": True, "action_dim": 57})
    assert actions["action"] is True and actions["action_dim"] == 57
    assert checkpoint_modes({}, {})["action"] is False
