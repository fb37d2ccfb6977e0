"""Guardrails as a job setting, in the project's own environment (no cosmos-guardrail here): the defaults, the
refusals before anything loads, and what `plan` adds for them. The checks themselves: tests/guardrails."""

from __future__ import annotations

import shutil

from cosmos3_batch.checkpoint import guardrail_cache
from cosmos3_batch.checkpoint.guardrail_cache import MAKE_TINY_MARKER
from cosmos3_batch.config import make_config
from cosmos3_batch.model.tiny import MARKER
from cosmos3_batch.pipeline.job.run import run_job
from cosmos3_batch.plan import guardrail_cost as cost
from cosmos3_batch.plan.hardware import preset
from cosmos3_batch.plan.job_plan import plan_job
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl

IMAGE = {"size": "32x32", "num_frames": 1, "num_inference_steps": 2}


def run(prompts, out, model, **flags):
    return run_job(make_config("allgather", None, prompts=str(prompts), out=out, model=model, progress=False,
                               **flags))  # fmt: skip


def real_copy(tiny_ckpt, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(tiny_ckpt, real)
    (real / MARKER).unlink()
    return real


def test_the_marker_that_makes_tiny_models_default_off_is_make_tinys():
    assert MAKE_TINY_MARKER == MARKER


def test_real_checkpoint_defaults_to_guardrails_and_refuses_without_their_package(
    tiny_ckpt, tmp_path, monkeypatch
):
    monkeypatch.setattr(guardrail_cache, "PACKAGE", "cosmos_guardrail_not_here")  # whatever this env holds
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "a red fox", **IMAGE}])
    code, _, error = run(prompts, tmp_path / "out", real_copy(tiny_ckpt, tmp_path))
    assert code == 2 and not (tmp_path / "out").exists()
    for fragment in ("cosmos-guardrail is not installed", "scripts/env.sh guardrails", "--no-guardrails"):
        assert fragment in error


def test_a_request_asking_for_guardrails_in_a_job_without_them_is_refused(tiny_ckpt, tmp_path):
    row = {"id": "a", "prompt": "a red fox", "extra_params": {"guardrails": True}, **IMAGE}
    code, _, error = run(write_jsonl(tmp_path / "p.jsonl", [row]), tmp_path / "out", tiny_ckpt)
    assert code == 2 and "extra_params.guardrails" in error and "--guardrails" in error


def test_guardrail_cost_from_the_models_sizes(tmp_path):
    (r,) = load_requests(str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "size": "1280x720"}])))[0]
    assert (r.width, r.height, r.num_frames) == (1280, 720, 189)
    got = cost.guardrail_cost([r], preset("h200"))
    assert got.resident_gib == (596e6 * 2 + 27.3e6 * 4) / 2**30
    assert got.video_peak_gib == (1280 * 720 * 189 * 12 + 1280 * 720 * 150) / 2**30
    assert got.text_s == 2 * 596e6 * 600 / (0.6 * 989e12) + 12 * 0.015
    frame = 1280 * 720 * 2.1e5 / (0.6 * 989e12 * 0.5) + 0.002
    assert got.video_s == frame * 189


def test_plan_shows_guardrails_for_a_real_checkpoint_only(tiny_ckpt, tmp_path):
    prompts = str(write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "a red fox", **IMAGE}]))
    real = real_copy(tiny_ckpt, tmp_path)
    doc, text = plan_job(prompts, str(real), 1, 1, "allgather", 1, preset("h200"))
    assert doc["guardrails"] == cost.guardrail_cost(load_requests(prompts)[0], preset("h200")).to_dict()
    assert "guardrails (cosmos-guardrail" in text
    assert "guardrails" not in plan_job(prompts, str(tiny_ckpt), 1, 1, "allgather", 1, preset("h200"))[0]
    assert (
        "guardrails"
        not in plan_job(prompts, str(real), 1, 1, "allgather", 1, preset("h200"), guardrails=False)[0]
    )


def test_an_fp8_copy_of_a_make_tiny_model_keeps_its_no_guardrails_default(tiny_ckpt, tmp_path):
    from cosmos3_batch.checkpoint.convert import convert_fp8
    from cosmos3_batch.model.loading import decoder_linear_weights

    convert_fp8(tiny_ckpt, tmp_path / "fp8", decoder_linear_weights)
    assert guardrail_cache.written_by_make_tiny(tmp_path / "fp8")
    assert not (tmp_path / "fp8" / MARKER).exists()  # make-tiny still refuses to overwrite it
    assert not guardrail_cache.written_by_make_tiny(real_copy(tiny_ckpt, tmp_path))
