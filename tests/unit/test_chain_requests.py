"""The chained stages' fields and flags (issue 45, requests/chain.py): validated with line and field,
the job's flags as defaults a line overrides, the record (and so the hash) holding the template's digest and
settings; the reply and score parsers and the template's fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.requests.chain import (
    DEFAULT_CAPTION,
    DEFAULT_TEMPLATE,
    chain_defaults,
    fill,
    parse_reply,
    parse_score,
    skip_reason,
)
from cosmos3_batch.requests.fields import ModelLimits
from cosmos3_batch.requests.parse import load_requests, parse_lines

LIMITS = ModelLimits(reasoner_missing=())
ROW = {"prompt": "a cat", "size": "32x32", "num_frames": 1}


def _parse(*objects, limits=LIMITS):
    return parse_lines([json.dumps(o).encode() for o in objects], limits=limits)


def test_fields_select_the_stages_and_the_flags_are_defaults_a_line_overrides():
    (up, cap, off), errors = _parse(
        {**ROW, "upsample": True},
        {**ROW, "caption_instruction": "Say what.", "score_instruction": "1-5?"},
        {**ROW, "upsample": False},
    )
    assert errors == []
    assert up.upsample.template == DEFAULT_TEMPLATE and up.upsample.format == "json" and up.captions is None
    assert (cap.captions.caption, cap.captions.score, cap.upsample) == ("Say what.", "1-5?", None)
    assert off.upsample is None
    flags = chain_defaults(True, "Mine: {prompt}", "text", "original", 50, True, 7)
    (default, opted_out), errors = _parse(ROW, {**ROW, "upsample": False, "caption_instruction": False},
                                          limits=ModelLimits(reasoner_missing=(), chain=flags))  # fmt: skip
    assert errors == []
    assert (default.upsample.template, default.upsample.fallback, default.upsample.max_new_tokens) == (
        "Mine: {prompt}", "original", 50,
    )  # fmt: skip
    assert default.captions.caption == DEFAULT_CAPTION and default.captions.max_new_tokens == 7
    assert opted_out.upsample is None and opted_out.captions is None


def test_the_record_holds_the_templates_digest_so_a_new_template_is_a_new_request():
    (plain,), _ = _parse(ROW)
    (a,), _ = _parse({**ROW, "upsample": True})
    flags = chain_defaults(False, "Other: {prompt}", "json", "fail", 1024, False, 256)
    (b,), _ = _parse({**ROW, "upsample": True}, limits=ModelLimits(reasoner_missing=(), chain=flags))
    assert "upsample" not in plain.resolved() and "captions" not in plain.resolved()  # earlier records hold
    assert a.resolved()["upsample"]["template_sha256"] == a.upsample.template_sha256
    assert "template" not in a.resolved()["upsample"]
    assert len({plain.content_hash(), a.content_hash(), b.content_hash()}) == 3


def test_bad_values_are_named_by_field_and_line():
    _, errors = _parse(
        {**ROW, "upsample": "yes"},
        {**ROW, "caption_instruction": ""},
        {**ROW, "score_instruction": 3},
        {"prompt": "x", "reason": {}, "caption_instruction": True},
    )
    found = {(e.line, e.field) for e in errors}
    assert {
        (1, "upsample"),
        (2, "caption_instruction"),
        (3, "score_instruction"),
        (4, "caption_instruction"),
    } <= found
    _, errors = _parse(
        {**ROW, "caption_instruction": True}, limits=ModelLimits(reasoner_missing=("the ViT weights",))
    )
    assert errors[0].field == "caption_instruction" and "the ViT weights" in errors[0].message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--upsample-format", "yaml"], "--upsample-format must be one of json, text"),
        (["--upsample-fallback", "skip"], "--upsample-fallback must be one of fail, original"),
        (["--caption-max-new-tokens", "0"], "--caption-max-new-tokens must be >= 1"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path, flags, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(ROW) + "\n")
    result = CliRunner().invoke(app, ["run", str(prompts), "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 2 and message in result.output


def test_a_template_without_the_prompt_or_unreadable_exits_2(tmp_path):
    prompts, template = tmp_path / "p.jsonl", tmp_path / "t.txt"
    prompts.write_text(json.dumps(ROW) + "\n")
    template.write_text("Write something nice.")
    for path, message in ((template, "names no {prompt}"), (tmp_path / "none.txt", "cannot read it")):
        args = ["run", str(prompts), "--out", str(tmp_path / "o"), "--upsample-template", str(path)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and message in result.output


def test_reply_parser_takes_the_first_json_object_or_the_trimmed_text():
    assert parse_reply('Sure:\n```json\n{"scene": "a", "n": 1}\n```', "json") == (
        '{"scene": "a", "n": 1}',
        None,
    )
    assert parse_reply('{"x": "é"} {"y": 2}', "json") == ('{"x": "é"}', None)
    assert parse_reply("{broken {} then", "json") == (None, "the reply holds no JSON object")
    assert parse_reply("[1, 2]", "json") == (None, "the reply holds no JSON object")
    assert parse_reply("  a long prompt \n", "text") == ("a long prompt", None)
    assert parse_reply(" \n", "text") == (None, "the reply is empty")


def test_score_is_the_first_number_of_the_reply():
    assert parse_score("I would rate it 4/5.") == 4.0
    assert parse_score("Score: 3.5 (of 5)") == 3.5
    assert parse_score("-1") == -1.0
    assert parse_score("no idea") is None


def test_template_fields_and_what_is_skipped():
    template = "{prompt} | {media} | {width}x{height} {num_frames}@{fps} {duration_s}s {other}"
    video = "a 2.0-second video of 64x32 pixels at 24 frames per second"
    assert fill(template, "p", 64, 32, 49, 24.0) == f"p | {video} | 64x32 49@24 2.0s {{other}}"
    assert fill("{media}", "p", 64, 32, 1, 24.0) == "an image of 64x32 pixels"
    assert "action mode" in skip_reason("pick the cup", action=True)
    assert "already structured" in skip_reason(' {"scene": "x"}', action=False)
    assert skip_reason("{not json", action=False) is None and skip_reason("a cat", action=False) is None


def test_the_demos_dataset_requests_are_valid():
    """examples/dataset.jsonl (scripts/demo.sh runs it on make-tiny --reasoner): upsampled and captioned."""
    path = Path(__file__).resolve().parents[2] / "examples" / "dataset.jsonl"
    requests, errors = load_requests(str(path), LIMITS)
    assert errors == [] and [r.id for r in requests] == ["street", "kitchen", "plain"]
    assert [r.upsample is not None for r in requests] == [True, True, False]
    assert [r.captions.tasks() if r.captions else [] for r in requests] == [
        [("caption", DEFAULT_CAPTION)],
        [("caption", "Name every object you see."),
         ("score", "Rate the physical plausibility of this image from 1 to 5.")],
        [],
    ]  # fmt: skip
