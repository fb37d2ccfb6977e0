"""Inputs as users have them (DESIGN.md §13): JSON, Parquet and CSV files read as their JSONL twin, globs
and standard input, columns under other names, errors naming file and place, and samples per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.requests.fields import MAX_SEED
from cosmos3_batch.requests.parse import RequestFileError, load_requests
from cosmos3_batch.requests.sources import Columns
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON, run_here
from tests.reference import reference_kwargs

# Every kind of field a table must carry: text, integers, floats, booleans, a list (condition_frames is
# V2V only, so the structured one here is extra_params) and a relative path.
ROWS = [
    {"id": "a", "prompt": "a cat", "size": "32x32", "num_frames": 1, "num_inference_steps": 2, "seed": 7},
    {"id": "b", "prompt": "snow, falling", "size": "48x32", "num_frames": 5, "num_inference_steps": 1,
     "guidance_scale": 1.0, "seed": 8, "flow_shift": 2.0, "system_prompt": False},
    {"id": "c", "prompt": "a red cube", "negative_prompt": "blurry", "size": "32x32", "num_frames": 5,
     "num_inference_steps": 1, "seed": 9, "image": "cond.png",
     "extra_params": {"use_resolution_template": False}},
]  # fmt: skip


def write_csv(path: Path, rows: list[dict]) -> Path:
    import csv

    columns = sorted({key for row in rows for key in row})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for row in rows:
            cells = {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in row.items()}
            writer.writerow({k: str(v).lower() if isinstance(v, bool) else v for k, v in cells.items()})
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    columns = sorted({key for row in rows for key in row})
    # Missing cells are nulls; extra_params a struct column, as HF datasets writes a dict field.
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows]), path)
    return path


@pytest.fixture
def folder(tmp_path, cond_image) -> Path:
    (tmp_path / "cond.png").write_bytes(cond_image.read_bytes())
    return tmp_path


def resolved(requests) -> list[dict]:
    return [r.resolved() for r in requests]


@pytest.mark.parametrize("fmt", ["json-array", "json-object", "parquet", "csv"])
def test_each_format_reads_as_its_jsonl_twin(folder, fmt):
    expected, _ = load_requests(str(write_jsonl(folder / "p.jsonl", ROWS)))
    if fmt == "json-array":
        (folder / "p.json").write_text(json.dumps(ROWS, indent=2))
        path = folder / "p.json"
    elif fmt == "json-object":  # one request per file, as NVIDIA's cosmos-predict takes them
        (folder / "p.json").write_text(json.dumps(ROWS[2]))
        expected, path = expected[2:], folder / "p.json"
    elif fmt == "parquet":
        path = write_parquet(folder / "p.parquet", ROWS)
    else:
        path = write_csv(folder / "p.csv", ROWS)
    got, errors = load_requests(str(path))
    assert errors == []
    assert resolved(got) == resolved(expected)  # the same requests, hashes and all
    assert got[-1].image == str(folder / "cond.png")  # relative to the file's folder


def test_files_and_globs_together_with_unique_ids_and_each_folder_for_paths(folder):
    sub = folder / "sub"
    sub.mkdir()
    (sub / "cond.png").write_bytes((folder / "cond.png").read_bytes())
    write_jsonl(folder / "one.jsonl", ROWS[:1])
    (sub / "x.json").write_text(json.dumps([{**ROWS[2], "id": "c-sub"}]))
    (sub / "y.json").write_text(json.dumps({**ROWS[1], "id": "b-sub"}))
    requests, errors = load_requests([str(folder / "one.jsonl"), str(sub / "*.json")])
    assert errors == []
    assert [r.id for r in requests] == ["a", "c-sub", "b-sub"]  # in argument order, a glob's matches sorted
    assert requests[1].image == str(sub / "cond.png") and requests[1].source == str(sub / "x.json")
    with pytest.raises(RequestFileError) as err:
        load_requests([str(folder / "one.jsonl"), str(folder / "one.jsonl"), str(folder / "none*.csv")])
    assert (
        str(err.value) == f"{folder / 'none*.csv'}: no file matches this pattern"
    )  # a path given twice is read once
    (sub / "again.json").write_text(json.dumps([ROWS[0]]))
    with pytest.raises(RequestFileError) as err:
        load_requests([str(folder / "one.jsonl"), str(sub / "again.json")])
    assert str(err.value) == (
        f"{sub / 'again.json'}: item 1, field 'id': duplicate id 'a': already used on line 1 of "
        f"{folder / 'one.jsonl'}"
    )


def test_a_hostile_row_is_named_by_file_and_place_in_every_format(folder):
    bad = [ROWS[0], {**ROWS[1], "num_frames": "five"}]
    paths = {
        "jsonl": write_jsonl(folder / "p.jsonl", bad),
        "json": folder / "p.json",
        "parquet": write_parquet(folder / "p.parquet", [ROWS[0], {**ROWS[1], "num_frames": -5}]),
        "csv": write_csv(folder / "p.csv", bad),
    }
    paths["json"].write_text(json.dumps(bad))
    where = {
        "jsonl": "line 2",
        "json": "item 2",
        "parquet": "row 2",
        "csv": "line 3",
    }  # CSV: header is line 1
    for fmt, path in paths.items():
        with pytest.raises(RequestFileError) as err:
            load_requests(str(path))
        assert str(err.value).startswith(f"{path}: {where[fmt]}, field 'num_frames': "), (
            fmt,
            err.value,
        )
    (folder / "broken.json").write_text('[{"prompt": "x"},\n  {"prompt": }]')
    (folder / "broken.parquet").write_bytes(b"PAR1 not really")
    (folder / "ragged.csv").write_text("prompt,seed\nx,1\ny,2,3\n")
    (folder / "bad.csv").write_text('prompt,action\nx,"{not json"\n')
    expected = {
        "broken.json": "not valid JSON: Expecting value (line 2, column 14)",
        "broken.parquet": "not a readable Parquet file",
        "ragged.csv": "line 3: 1 cell(s) more than the header's columns",
        "bad.csv": "line 2: column 'action': not valid JSON",
    }
    for name, message in expected.items():
        with pytest.raises(RequestFileError) as err:
            load_requests(str(folder / name))
        assert str(err.value).startswith(f"{folder / name}: {message}"), err.value


def test_columns_under_other_names(folder):
    table = [{"key": "k1", "caption": "a cat", "size": "32x32", "num_frames": 1}]
    path = write_parquet(folder / "captions.parquet", table)
    (request,), _ = load_requests(str(path), columns=Columns(prompt="caption", id="key"))
    assert (request.id, request.prompt) == ("k1", "a cat")
    with pytest.raises(RequestFileError, match="unknown keys 'caption', 'key'"):
        load_requests(str(path))
    both = write_csv(folder / "both.csv", [{"prompt": "x", "caption": "y"}])
    with pytest.raises(RequestFileError, match="has both 'caption' \\(the --prompt-column\\) and 'prompt'"):
        load_requests(str(both), columns=Columns(prompt="caption"))


def test_samples_fan_out_with_ids_and_seeds():
    rows = [
        {"id": "s", "prompt": "x", "seed": 40, "samples": 12},
        {"id": "d", "prompt": "y", "samples": 1},
        {"id": "p", "prompt": "z"},
    ]
    requests, errors = load_requests_from(rows, samples=3)
    assert errors == []
    ids = [r.id for r in requests]
    assert ids[:12] == [f"s-{k:02d}" for k in range(12)]  # zero-padded to the width of 12
    assert [r.seed for r in requests[:12]] == list(range(40, 52))
    assert ids[12:] == ["d-0", "p-0", "p-1", "p-2"]  # the field wins over --samples-per-prompt
    derived = load_requests_from([{"id": "p", "prompt": "z"}])[0][0].seed  # the seed of id "p" alone
    assert [r.seed for r in requests[13:]] == [derived, derived + 1, derived + 2]
    assert len({r.content_hash() for r in requests}) == len(requests)
    for bad, message in [
        (0, "field 'samples': must be >= 1 and <= 10000, got 0"),
        (True, "field 'samples': must be an integer, got a boolean"),
        (10_001, "must be >= 1 and <= 10000"),
        (10**9, "must be >= 1 and <= 10000"),  # reported, never expanded into a billion ids
    ]:
        _, errors = load_requests_from([{"prompt": "x", "samples": bad}], skip_invalid=True)
        assert message in str(errors[0]), errors
    _, errors = load_requests_from([{"prompt": "x", "seed": MAX_SEED - 1, "samples": 3}], skip_invalid=True)
    assert "field 'samples': seeds" in str(errors[0])
    _, errors = load_requests_from(
        [{"id": "s-1", "prompt": "x"}, {"id": "s", "prompt": "y", "samples": 2}], True
    )
    assert str(errors[0]) == "line 2, field 'id': duplicate id 's-1': already used on line 1"


def load_requests_from(rows, skip_invalid=False, samples=1):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return load_requests(
            str(write_jsonl(Path(tmp) / "p.jsonl", rows)), skip_invalid=skip_invalid, samples=samples
        )


def test_shard_splits_samples_like_any_request(tiny_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "s", "prompt": "x", "size": "32x32", "samples": 8}])
    shards = []
    for index in range(2):
        result = CliRunner().invoke(app, ["plan", str(prompts), "--shard", f"{index}/2", "--json"])
        assert result.exit_code == 0, result.output
        shards.append({i for rank in json.loads(result.output)["ranks"] for i in rank["ids"]})
    assert shards[0] | shards[1] == {f"s-{k}" for k in range(8)} and not shards[0] & shards[1]
    assert shards[0] and shards[1]


def test_every_format_and_stdin_give_the_jsonl_latents_and_samples_the_reference(folder, tiny_ckpt):
    """One job over every format (ids and seeds explicit, so the same content is the same noise), one
    from standard input; a sample against `Cosmos3OmniPipeline.__call__` with its seed."""
    rows = [{**row, "num_inference_steps": 1} for row in ROWS[:2]]

    def tagged(tag):
        return [{**row, "id": f"{row['id']}-{tag}"} for row in rows]

    write_jsonl(folder / "p.jsonl", tagged("jsonl"))
    (folder / "p.json").write_text(json.dumps(tagged("json")))
    write_parquet(folder / "p.parquet", tagged("parquet"))
    write_csv(folder / "p.csv", tagged("csv"))
    boat = {"id": "n", "prompt": "a boat", "size": "32x32", "seed": 3, "num_frames": 1}
    boat["num_inference_steps"] = 2
    write_jsonl(folder / "samples.jsonl", [{**boat, "samples": 2}])
    out = folder / "out"
    files = [str(folder / name) for name in ("p.jsonl", "p.json", "p.parquet", "p.csv", "samples.jsonl")]
    assert (
        run_here(["run", *files, "--model", tiny_ckpt, "--out", out, "--save-latents", "--no-progress"]) == 0
    )

    def latents(rid, where=out):
        return load_file(where / f"{rid}.latents.safetensors")["latents"]

    for row in rows:
        for tag in ("json", "parquet", "csv"):
            assert torch.equal(latents(f"{row['id']}-{tag}"), latents(f"{row['id']}-jsonl")), (row["id"], tag)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == 10 and summary["config"]["prompts"] == files

    stdin_out = folder / "stdin"
    lines = "".join(json.dumps(row) + "\n" for row in tagged("jsonl")).encode()
    args = ["run", "-", "--model", str(tiny_ckpt), "--out", str(stdin_out), "--save-latents", "--no-progress"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_here ran the files
    try:
        result = CliRunner().invoke(app, args, input=lines)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    for row in rows:
        assert torch.equal(latents(f"{row['id']}-jsonl", stdin_out), latents(f"{row['id']}-jsonl"))

    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    pipe.set_progress_bar_config(disable=True)
    sample = next(r for r in load_requests(str(folder / "samples.jsonl"))[0] if r.id == "n-1")
    assert sample.seed == 4
    pipe.scheduler = UniPCMultistepScheduler.from_config(dict(pipe.scheduler.config))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_here ran it
    try:
        generator = torch.Generator("cpu").manual_seed(sample.seed)
        expected = pipe(**reference_kwargs(sample), generator=generator, output_type="latent").video
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(latents("n-1"), expected)
    assert not torch.equal(latents("n-0"), latents("n-1"))


@pytest.mark.dist  # a real process killed mid-run
def test_a_kill_mid_fan_out_resumes_the_missing_samples(tiny_ckpt, tmp_path):
    import csv
    import os
    import signal
    import subprocess
    import time
    from collections import Counter

    row = {"id": "s", "prompt": "x", "size": "32x32", "num_frames": 1, "num_inference_steps": 30}
    row["samples"] = 6
    prompts = write_jsonl(tmp_path / "p.jsonl", [row])
    out = tmp_path / "out"
    args = ["run", str(prompts), "--model", str(tiny_ckpt), "--out", str(out), "--max-active", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([JOB_PYTHON, "-m", "cosmos3_batch", *args, "--no-progress"], env=env)
    deadline = time.monotonic() + 180
    while len(list(out.glob("s-*.json"))) < 2 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    done = {p.stem for p in out.glob("s-*.json")}
    assert 2 <= len(done) < 6, done
    assert run_here([*args, "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_complete_ids"] == sorted(done)
    assert summary["generated_ok"] == 6 - len(done)
    ok: Counter = Counter()
    for part in (out / ".cosmos3_batch").glob("metrics.*csv"):
        with open(part, newline="") as f:
            ok.update(r["id"] for r in csv.DictReader(f) if r["status"] == "ok")
    assert max(ok.values()) == 1 and set(ok) >= {f"s-{k}" for k in range(6)} - done  # none twice
