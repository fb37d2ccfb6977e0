"""`plan --model` validates exactly what `run` validates before loading weights (issue 49, DESIGN.md §13):
on a corpus of bad inputs both exit 2 with the same message, the prompts' token counts after templating
included (plan used to call a prompt `run` refuses "1 valid requests", exit 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app

GOOD = {"prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
LONG = "a very long prompt about a red cube on a wooden table in a bright and sunny room " * 3


def jsonl(*rows: dict | str) -> str:
    return "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)


# name -> (file name, content): each is refused by both commands
CORPUS = {
    "too-long-prompt": ("p.jsonl", jsonl(GOOD, {**GOOD, "prompt": LONG, "max_sequence_length": 5})),
    "too-long-negative": ("p.jsonl", jsonl({**GOOD, "negative_prompt": LONG, "max_sequence_length": 40})),
    "too-long-for-the-model": ("p.jsonl", jsonl({**GOOD, "prompt": LONG * 40})),
    "two-errors-on-a-line": ("p.jsonl", jsonl(GOOD, {"prompt": "y", "seed": True, "fps": -1})),
    "unknown-key": ("p.jsonl", jsonl({**GOOD, "caption": "x"})),
    "not-json": ("p.jsonl", jsonl(GOOD, "not json")),
    "duplicate-id": ("p.jsonl", jsonl({**GOOD, "id": "a"}, {**GOOD, "id": "a"})),
    "size": ("p.jsonl", jsonl({**GOOD, "size": "50x32"})),
    "bad-and-too-long": (
        "p.jsonl",
        jsonl({"prompt": ""}, {**GOOD, "prompt": LONG, "max_sequence_length": 9}),
    ),
    "samples": ("p.jsonl", jsonl({**GOOD, "samples": 0})),
    "empty": ("p.jsonl", "# nothing here\n"),
    "missing": ("missing.jsonl", None),
    "json-array-as-jsonl": ("p.jsonl", json.dumps([GOOD, GOOD], indent=1) + "\n"),
    "csv-caption": ("p.csv", "key,caption\na,a red cube\n"),
}


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def refusal(result) -> str:
    """What the command said from its `error:` line on (the lines after it name the rest)."""
    return result.output[result.output.index("error: ") :]


@pytest.mark.parametrize("name", list(CORPUS))
def test_plan_refuses_what_run_refuses_with_the_same_message(tmp_path: Path, tiny_ckpt: Path, name: str):
    filename, content = CORPUS[name]
    prompts = tmp_path / filename
    if content is not None:
        prompts.write_text(content)
    ran = invoke("run", prompts, "--model", tiny_ckpt, "--out", tmp_path / "out", "--no-progress")
    planned = invoke("plan", prompts, "--model", tiny_ckpt)
    assert (ran.exit_code, planned.exit_code) == (2, 2), (ran.output, planned.output)
    assert refusal(planned) == refusal(ran)
    assert not (tmp_path / "out").exists()


def test_plan_names_the_token_count_line_and_limit(tmp_path: Path, tiny_ckpt: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(jsonl(GOOD, {**GOOD, "prompt": LONG, "max_sequence_length": 200}))
    result = invoke("plan", prompts, "--model", tiny_ckpt)
    assert result.exit_code == 2
    assert refusal(result) == (
        f"error: {prompts}: line 2, field 'prompt': 382 tokens after templating exceed the limit of 200 "
        "(max_sequence_length)\n"
    )
    # Without --model there is no tokenizer: the same file plans (the token check is the model's).
    assert invoke("plan", prompts).exit_code == 0
