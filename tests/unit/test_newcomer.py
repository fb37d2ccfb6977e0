"""Inputs and messages as a newcomer meets them (issue 49): a missing input is a configuration error (exit 2)
in every command that reads one, with or without --skip-invalid; counts count requests, not errors; the
fixes the messages name exist."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from tests.conftest import write_jsonl

IMAGE = {"id": "img", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
NO_SUCH_FILE = "cannot read request file: No such file or directory"


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def errors(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error: ")]


@pytest.fixture
def ran(tmp_path: Path) -> Path:
    """An OUT a run has written to (status and manifest read it)."""
    (tmp_path / "out" / ".cosmos3_batch").mkdir(parents=True)
    return tmp_path / "out"


@pytest.mark.parametrize("skip", [(), ("--skip-invalid",)], ids=["plain", "skip-invalid"])
def test_run_of_a_missing_input_exits_2_naming_it(tmp_path: Path, tiny_ckpt: Path, skip: tuple) -> None:
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "out"
    result = invoke("run", missing, "--model", tiny_ckpt, "--out", out, "--no-progress", *skip)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {missing}: {NO_SUCH_FILE}"]
    assert not out.exists()  # no summary.json recording "line": 0, no folder at all


def test_skip_invalid_never_skips_a_missing_input_beside_a_good_one(tmp_path: Path, tiny_ckpt: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [IMAGE])
    missing, empty = tmp_path / "missing.jsonl", tmp_path / "empty.jsonl"
    empty.write_text("# only a comment\n")
    args = ("--model", tiny_ckpt, "--out", tmp_path / "out", "--no-progress", "--skip-invalid")
    result = invoke("run", good, missing, empty, tmp_path / "none*.jsonl", *args)
    assert result.exit_code == 2
    assert result.output.splitlines()[-3:] == [
        f"error: {tmp_path / 'none*.jsonl'}: no file matches this pattern",
        f"{missing}: {NO_SUCH_FILE}",
        f"{empty}: no requests in file",
    ]


def test_plan_of_a_missing_input_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = invoke("plan", missing)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {missing}: {NO_SUCH_FILE}"]


@pytest.mark.parametrize("command", ["status", "manifest"])
def test_status_and_manifest_of_a_missing_input_exit_2(ran: Path, command: str) -> None:
    missing = ran.parent / "missing.jsonl"
    result = invoke(command, ran, "--input", missing)
    assert result.exit_code == 2
    assert errors(result) == [f"error: --input: {missing}: {NO_SUCH_FILE}"]
    assert not (ran / "manifest.parquet").exists()


def test_invalid_counts_requests_each_with_all_its_errors(tmp_path: Path, tiny_ckpt: Path, caplog) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(IMAGE) + '\n{"prompt": "y", "seed": true, "fps": -1}\n')
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"1 generated, 0 failed, 0 already complete, 1 invalid -> {out}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_in_file"] == 2
    fps = {"field": "fps", "error": "must be > 0 and <= 240, got -1.0"}
    seed = {"field": "seed", "error": "must be an integer, got a boolean (true)"}
    assert summary["invalid"] == [{"file": str(prompts), "line": 2, "errors": [fps, seed]}]
    # The terminal shows what was skipped, not only a count.
    assert caplog.messages[-1] == (
        f"skipped (--skip-invalid):\n{prompts}: line 2, field 'fps': {fps['error']}\n"
        f"{prompts}: line 2, field 'seed': {seed['error']}"
    )


def test_an_uncached_model_names_the_download_command_the_installed_client_has() -> None:
    from importlib.metadata import entry_points

    from cosmos3_batch.checkpoint import hub

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["hf"].startswith("huggingface_hub.")  # `hf download`, as the message says
    assert "hf download {repo} --revision {revision}" in Path(hub.__file__).read_text()


def test_a_table_with_a_caption_column_is_pointed_at_the_column_flags(tmp_path: Path) -> None:
    from cosmos3_batch.requests.fields import ALLOWED_KEYS

    table = tmp_path / "t.csv"
    table.write_text("key,caption\na,a red cube\n")
    result = invoke("plan", table)
    assert result.exit_code == 2
    assert result.output == (
        f"error: {table}: line 2, field 'caption': unknown keys 'caption', 'key' ('caption' holds the "
        "prompt? pass --prompt-column caption; 'key' holds the id? pass --id-column key); allowed keys: "
        f"{', '.join(ALLOWED_KEYS)}\n{table}: line 2, field 'prompt': missing: every request needs a "
        "non-empty prompt\n"
    )
    assert invoke("plan", table, "--prompt-column", "caption", "--id-column", "key").exit_code == 0


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.jsonl", '[{"prompt": "x"}]\n', "line 1: each line must be a JSON object, got an array (a JSON "
         "array? name the file .json, or write one object per line)"),
        ("a.jsonl", '[{"prompt": "x"},\n{"prompt": "y"}]\n', "line 1: not valid JSON: Expecting value "
         "(column 18) (a JSON array? name the file .json, or write one object per line)\n{path}: line 2: "
         "not valid JSON: Extra data (column 16)"),
        ("a.json", '{"prompt": "x"}\n{"prompt": "y"}\n', "not valid JSON: Extra data (line 2, column 1; one "
         "object per line is JSONL: name the file .jsonl)"),
    ],
    ids=["array-on-one-line", "array-over-lines", "jsonl-as-json"],
)  # fmt: skip
def test_a_file_with_the_other_json_suffix_is_told_so(tmp_path: Path, name: str, content: str, message: str):
    path = tmp_path / name
    path.write_text(content)
    result = invoke("plan", path)
    assert result.exit_code == 2
    assert result.output == f"error: {path}: {message.format(path=path)}\n"


def _output(rid: str, finished: float, denoise_s: float):
    from cosmos3_batch.io.catalog import Output

    timings = {"prepare_s": 1.0, "denoise_s": denoise_s, "decode_s": 0.5, "write_s": 0.5}
    return Output(rid, {"timings": timings}, f"{rid}.png", None, finished)


def test_generation_time_counts_overlaps_once_and_no_stop() -> None:
    from cosmos3_batch.io.status import generation_seconds

    # Two outputs of one pass (10 s and 12 s spans ending together), then a stop of 20 minutes, then one
    # more (5 s): 12 + 5 seconds of generation, not the 20 minutes between.
    outputs = [_output("a", 1000.0, 8.0), _output("b", 1000.0, 10.0), _output("c", 2205.0, 3.0)]
    assert generation_seconds(outputs, since=0.0) == 17.0
    assert generation_seconds(outputs, since=995.0) == 10.0  # clipped to the window


def test_status_rate_is_over_generation_time_and_pending_is_null_without_input(
    tmp_path: Path, tiny_ckpt: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [IMAGE, {**IMAGE, "id": "img2"}])
    out = tmp_path / "out"
    assert invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress").exit_code == 0
    doc = json.loads(invoke("status", out, "--json").output)
    assert (doc["pending"], doc["pending_known"], doc["outputs_last_hour"]) == (None, False, 2)
    busy = doc["generation_s_last_hour"]
    assert 0 < busy < 3600 and doc["outputs_per_hour"] == pytest.approx(2 * 3600 / busy, rel=0.02)
    text = invoke("status", out).output.splitlines()
    assert text == [
        f"{out} (files): 2 requests: 2 done, 0 failed, 0 interrupted, ? (give --input) pending",
        f"last hour: 2 outputs in {busy:.0f} s of generation ({doc['outputs_per_hour']:.1f}/hour); "
        "ETA 0.00 h",
    ]
    assert json.loads(invoke("status", out, "--json", "--input", prompts).output)["pending"] == 0


def test_the_same_error_on_many_lines_is_said_once_with_its_lines(tmp_path: Path, tiny_ckpt: Path) -> None:
    """Reasoner requests against a checkpoint without the reasoner's parts fail on every line alike: one error
    line names them all (first lines listed, the count exact), and the one line that differs is still said."""
    rows = [{"id": f"r{i}", "prompt": "Describe it.", "reason": {"max_new_tokens": 4}} for i in range(12)]
    rows.insert(5, {**IMAGE, "num_frames": 0})
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    result = invoke("plan", prompts, "--model", tiny_ckpt)
    assert result.exit_code == 2
    said = result.output.strip().splitlines()
    assert len(said) == 3, said  # lines 1-5 alike, line 6 its own, lines 7-13 alike
    first = f"error: {prompts}: line 1, field 'reason': this checkpoint has no reasoner parts"
    assert said[0].startswith(first)
    assert said[0].endswith("(the same on 5 lines: 1, 2, 3, 4, 5)")
    assert said[1] == f"{prompts}: line 6, field 'num_frames': num_frames must be >= 1, got 0"
    assert said[2].endswith("(the same on 7 lines: 7, 8, 9, 10, 11, 12, 13)")
