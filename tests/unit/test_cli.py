"""The `run` and `make-tiny` commands end to end on the tiny checkpoint: files, exit codes, resume."""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model import numerics
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON

IMAGE = {"id": "img", "prompt": "a red cube", "num_frames": 1, "size": "32x48", "num_inference_steps": 2}
VIDEO = {
    "id": "vid",
    "prompt": "a cat",
    "num_frames": 9,
    "size": "48x32",
    "num_inference_steps": 2,
    "fps": 12,
}


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def run(tiny_ckpt, prompts, out, *extra):
    return invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", *extra)


@pytest.fixture
def job(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", [IMAGE, VIDEO])
    return prompts, tmp_path / "out"


def test_run_writes_every_output(job, tiny_ckpt):
    prompts, out = job
    result = run(tiny_ckpt, prompts, out, "--save-latents")
    assert result.exit_code == 0, result.output
    png = np.array(Image.open(out / "img.png"))
    assert png.shape == (48, 32, 3) and png.dtype == np.uint8
    frames = iio.imread(out / "vid.mp4", plugin="FFMPEG")
    meta = iio.immeta(out / "vid.mp4", plugin="FFMPEG")
    assert frames.shape == (9, 32, 48, 3)
    assert meta["codec"] == "h264" and meta["pix_fmt"].startswith("yuv420p") and meta["fps"] == 12.0
    sidecar = json.loads((out / "vid.json").read_text())
    assert sidecar["status"] == "complete" and sidecar["kind"] == "t2v"
    assert sidecar["request"]["num_inference_steps"] == 2 and sidecar["request"]["fps"] == 12.0
    assert sidecar["files"]["media"] == {"name": "vid.mp4", "bytes": (out / "vid.mp4").stat().st_size}
    assert set(sidecar["versions"]) == {"cosmos3_batch", "torch", "diffusers", "transformers"}
    assert load_file(out / "vid.latents.safetensors")["latents"].shape == (1, 16, 3, 2, 3)
    with open(out / "metrics.csv") as f:
        rows = {row["id"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["img", "vid"]
    assert (
        rows["img"]["status"] == "ok" and rows["img"]["kind"] == "t2i" and rows["img"]["output"] == "img.png"
    )
    assert rows["vid"]["width"] == "48" and rows["vid"]["num_frames"] == "9" and rows["vid"]["error"] == ""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == 2 and summary["failed"] == [] and summary["skipped_complete"] == 0
    # The numerics the bits came from, for anyone reproducing them with a plain diffusers run.
    assert summary["cpu_numerics"] == numerics.cpu_numerics()
    leftovers = [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert leftovers == []


def test_png_and_latents_equal_the_reference_pipeline(job, tiny_ckpt):
    prompts, out = job
    assert run(tiny_ckpt, prompts, out, "--save-latents").exit_code == 0
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    pipe.set_progress_bar_config(disable=True)
    seed = json.loads((out / "img.json").read_text())["seed"]
    kwargs = dict(prompt="a red cube", num_frames=1, height=48, width=32, num_inference_steps=2)
    pil = pipe(**kwargs, generator=torch.Generator().manual_seed(seed)).video[0]
    assert np.array_equal(np.array(Image.open(out / "img.png")), np.array(pil))
    latents = pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="latent").video
    assert torch.equal(load_file(out / "img.latents.safetensors")["latents"], latents)


def test_rerun_resumes_and_overwrite_regenerates(job, tiny_ckpt):
    prompts, out = job
    assert run(tiny_ckpt, prompts, out).exit_code == 0
    mtime = (out / "vid.mp4").stat().st_mtime_ns
    again = run(tiny_ckpt, prompts, out)
    assert again.exit_code == 0
    assert "0 generated, 0 failed, 2 already complete" in again.output
    assert (out / "vid.mp4").stat().st_mtime_ns == mtime
    # Same id, different content: regenerated (the sidecar holds the request's hash).
    write_jsonl(prompts, [IMAGE, {**VIDEO, "num_inference_steps": 3}])
    assert "1 generated, 0 failed, 1 already complete" in run(tiny_ckpt, prompts, out).output
    assert json.loads((out / "vid.json").read_text())["request"]["num_inference_steps"] == 3
    assert "2 generated" in run(tiny_ckpt, prompts, out, "--overwrite").output


def test_truncated_output_is_not_taken_as_complete(job, tiny_ckpt):
    prompts, out = job
    assert run(tiny_ckpt, prompts, out).exit_code == 0
    data = (out / "vid.mp4").read_bytes()
    (out / "vid.mp4").write_bytes(data[: len(data) // 2])
    assert "1 generated, 0 failed, 1 already complete" in run(tiny_ckpt, prompts, out).output
    assert (out / "vid.mp4").stat().st_size == len(data)


def test_bad_file_exits_2_listing_every_line_and_writes_nothing(tmp_path, tiny_ckpt):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(
        json.dumps(IMAGE) + "\n"
        "# a comment\n"
        '{"prompt": "x", "size": "50x32"}\n'
        '{"prompt": "", "num_frames": 10}\n'
        "not json\n"
    )
    result = run(tiny_ckpt, prompts, tmp_path / "out")
    assert result.exit_code == 2
    assert "line 3, field 'size'" in result.output and "nearest valid: 48 or 64" in result.output
    assert "line 4, field 'prompt'" in result.output and "line 4, field 'num_frames'" in result.output
    assert "use 9 or 13" in result.output and "line 5: not valid JSON" in result.output
    assert not (tmp_path / "out").exists()


def test_skip_invalid_runs_the_valid_lines(tmp_path, tiny_ckpt):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(IMAGE) + "\n" + '{"prompt": "x", "seed": true}\n')
    result = run(tiny_ckpt, prompts, tmp_path / "out", "--skip-invalid")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["generated_ok"] == 1
    assert summary["invalid"] == [
        {
            "file": str(prompts),
            "line": 2,
            "errors": [{"field": "seed", "error": "must be an integer, got a boolean (true)"}],
        }
    ]


def test_prompt_over_max_sequence_length_exits_2(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{**IMAGE, "max_sequence_length": 50}])
    result = run(tiny_ckpt, prompts, tmp_path / "out")
    assert result.exit_code == 2
    assert (
        "line 1, field 'prompt'" in result.output
        and "exceed the limit of 50 (max_sequence_length)" in result.output
    )


def test_failed_request_is_recorded_and_others_finish(job, tiny_ckpt):
    prompts, out = job
    (out / "img.png").mkdir(parents=True)  # the PNG cannot be renamed over a folder: a write error
    result = run(tiny_ckpt, prompts, out)
    assert result.exit_code == 1
    with open(out / "metrics.csv") as f:
        rows = {row["id"]: row for row in csv.DictReader(f)}
    assert rows["img"]["status"] == "failed" and "img.png" in rows["img"]["error"]
    assert rows["vid"]["status"] == "ok"
    summary = json.loads((out / "summary.json").read_text())
    assert [f["id"] for f in summary["failed"]] == ["img"]
    assert not (out / "img.json").exists()


def test_missing_component_exits_2(tmp_path, tiny_ckpt):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text((tiny_ckpt / "model_index.json").read_text())
    prompts = write_jsonl(tmp_path / "p.jsonl", [IMAGE])
    result = run(broken, prompts, tmp_path / "out")
    assert result.exit_code == 2 and "component folder 'transformer/' is missing" in result.output


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.rglob("*.safetensors")):
        h.update(file.read_bytes())
    return h.hexdigest()


def test_make_tiny_is_deterministic_and_sized_by_flags(tmp_path):
    args = ("--layers", "3", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "48")
    assert invoke("make-tiny", tmp_path / "a", *args).exit_code == 0
    assert invoke("make-tiny", tmp_path / "b", *args).exit_code == 0
    assert invoke("make-tiny", tmp_path / "c", *args, "--seed", "1").exit_code == 0
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")
    config = json.loads((tmp_path / "a" / "transformer" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (3, 32, 1)
    bad = invoke("make-tiny", tmp_path / "d", "--hidden", "30")
    assert bad.exit_code == 2 and "multiple of --heads" in bad.output


def test_help_explains_every_flag():
    text = invoke("run", "--help").output
    for flag in (
        "--model",
        "--out",
        "--max-active",
        "--save-latents",
        "--vae-tiling",
        "--skip-invalid",
        "--overwrite",
        "--max-reason-active",
        "--und-resident",
        "--no-und-resident",
    ):
        assert flag in text
    assert "--max-reason-active" in invoke("plan", "--help").output


def test_max_reason_active_below_1_is_refused_before_loading(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "r", "prompt": "Describe.", "reason": {}}])
    for command in (["run", prompts, "--out", tmp_path / "out"], ["plan", prompts]):
        result = invoke(*command, "--max-reason-active", "0")
        assert result.exit_code == 2 and "--max-reason-active must be >= 1, got 0" in result.output
    assert not (tmp_path / "out").exists()


def test_python_dash_m_entry_point(job, tiny_ckpt):
    prompts, out = job
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch", "run", prompts, "--model", tiny_ckpt, "--out", out]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 generated, 0 failed" in proc.stdout


def test_plan_balances_ranks_deterministically(tmp_path):
    rows = [{"id": f"p{i}", "prompt": "x", "num_frames": 1 + 4 * (i % 3), "size": "64x64"} for i in range(7)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    first = invoke("plan", prompts, "--nproc", "3", "--json")
    assert first.exit_code == 0, first.output
    doc = json.loads(first.output)
    assert invoke("plan", prompts, "--nproc", "3", "--json").output == first.output
    assert sorted(i for rank in doc["ranks"] for i in rank["ids"]) == sorted(r["id"] for r in rows)
    work = [rank["predicted_work"] for rank in doc["ranks"]]
    assert sum(work) == doc["total_work"]
    assert max(work) - min(work) <= max(work) / 2  # LPT: no rank far above the others
    text = invoke("plan", prompts, "--nproc", "3").output
    assert "predicted idle share" in text and "7 valid requests on 3 rank(s)" in text
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}])
    assert invoke("plan", bad).exit_code == 2
    negative = invoke("plan", prompts, "--chunk-gap-passes", "-1")
    assert negative.exit_code == 2 and "--chunk-gap-passes must be >= 0, got -1" in negative.output


def test_array_shards_share_one_out_folder(tmp_path, tiny_ckpt):
    rows = [{**IMAGE, "id": f"s{i}", "num_inference_steps": 1} for i in range(5)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    for index in range(2):
        assert run(tiny_ckpt, prompts, out, "--shard", f"{index}/2").exit_code == 0
    assert sorted(p.stem for p in out.glob("s*.png")) == [f"s{i}" for i in range(5)]
    made = [json.loads((out / f"summary.shard{k}of2.json").read_text())["generated_ok"] for k in range(2)]
    assert sum(made) == 5 and min(made) > 0
    with open(out / "metrics.csv") as f:
        assert sorted(row["id"] for row in csv.DictReader(f)) == [f"s{i}" for i in range(5)]
    assert not (out / "summary.json").exists()
    assert run(tiny_ckpt, prompts, out, "--shard", "2/2").exit_code == 2


def test_plan_without_model_says_what_model_adds_and_warns_of_idle_ranks(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [IMAGE])
    text = invoke("plan", prompts, "--nproc", "4").output
    assert "add --model CKPT for memory per rank" in text
    assert "WARNING: predicted idle share 75%" in text  # one request, four ranks


def test_plan_prints_no_roofline_it_cannot_resolve(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", [IMAGE, VIDEO])
    result = invoke("plan", prompts, "--model", tiny_ckpt)
    assert result.exit_code == 0, result.output
    assert "too small a model for the roofline" in result.output and "outputs per hour" not in result.output
    doc = json.loads(invoke("plan", prompts, "--model", tiny_ckpt, "--json").output)
    assert doc["estimate"]["outputs_per_hour"] is None and doc["estimate"]["bytes_h2d_per_pass"] > 0


def test_make_tiny_never_replaces_a_folder_it_did_not_write(tmp_path):
    foreign = tmp_path / "ckpt"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (foreign / "model_index.json").write_text("{}")
    result = invoke("make-tiny", foreign)
    assert result.exit_code == 2 and "--force" in result.output
    assert sorted(p.name for p in foreign.iterdir()) == ["model_index.json", "notes.txt"]
    assert (foreign / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert invoke("make-tiny", a_file).exit_code == 2 and a_file.read_text() == "x"

    ours = tmp_path / "tiny"
    assert invoke("make-tiny", ours).exit_code == 0
    (ours / "stale.txt").write_text("left by hand")
    assert invoke("make-tiny", ours, "--layers", "1").exit_code == 0  # its own output: replaced
    assert not (ours / "stale.txt").exists()
    assert json.loads((ours / "tiny_spec.json").read_text())["layers"] == 1
    assert invoke("make-tiny", foreign, "--force").exit_code == 0
    assert not (foreign / "notes.txt").exists() and (foreign / "transformer").is_dir()


def test_rerun_with_nothing_to_do_names_the_skipped_and_loads_nothing(job, tiny_ckpt, monkeypatch, caplog):
    prompts, out = job
    assert run(tiny_ckpt, prompts, out).exit_code == 0
    import cosmos3_batch.pipeline.job.load as job_module

    def no_loading(*args, **kwargs):
        raise AssertionError("a rerun with nothing to generate must not load the model")

    monkeypatch.setattr(job_module, "load_context", no_loading)
    with caplog.at_level("INFO", logger="cosmos3_batch"):
        result = run(tiny_ckpt, prompts, out)
    assert result.exit_code == 0, result.output
    assert "0 generated, 0 failed, 2 already complete" in result.output
    assert "2 already complete: img, vid" in caplog.text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_complete_ids"] == ["img", "vid"]


def test_every_command_and_flag_has_help():
    import typer.main

    group = typer.main.get_command(app)
    assert set(group.commands) >= {"run", "plan", "make-tiny", "report"}
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            assert getattr(param, "help", None), (name, param.name)


def test_metrics_of_an_older_version_are_kept_and_moved(job, tiny_ckpt):
    prompts, out = job
    out.mkdir(parents=True)
    old_columns = "id,status,kind,latency_s,rank,finished_at,output,error\n"
    (out / ".metrics.rank0.csv").write_text(old_columns + "earlier,ok,t2i,1.5,0,1796000000.5,earlier.png,\n")
    (out / ".metrics.lock").write_text("")
    assert run(tiny_ckpt, prompts, out).exit_code == 0
    with open(out / "metrics.csv", newline="") as f:
        rows = {row["id"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["earlier", "img", "vid"]
    assert rows["earlier"]["latency_s"] == "1.5" and rows["earlier"]["queue_s"] == ""
    assert not (out / ".metrics.rank0.csv").exists() and not (out / ".metrics.lock").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".cosmos3_batch"]
