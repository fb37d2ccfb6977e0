"""Reasoner requests through the pass loop (issue 44 items 3-5) at world 1: token ids equal transformers'
`generate` (tests/reasoner_reference.py) bit for bit on CPU float32, greedy and sampled, text only and with an
image, several sequences sharing passes and ending at EOS at different steps, beside T2I and T2V requests
whose latents equal their run without them; the outputs (`<id>.txt`, sidecar, metrics, manifest), resume."""

from __future__ import annotations

import csv
import json

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.requests.reason import ReasonSpec
from tests.conftest import write_jsonl
from tests.reasoner_reference import eos_between, reference_ids, with_eos

SAMPLED = {"do_sample": True, "top_k": 20, "temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2}
T2I = {"id": "t2i", "prompt": "a red square", "size": "64x64", "num_frames": 1, "num_inference_steps": 3}
T2V = {"id": "t2v", "prompt": "a blue ball rolls", "size": "48x32", "num_frames": 5, "num_inference_steps": 3}


def _run(ckpt, prompts, out, *extra):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", *extra]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _rows(cond_image):
    system, image = "Answer in one sentence.", str(cond_image)
    return [
        {"id": "text", "prompt": "Describe a kitchen.", "reason": {"max_new_tokens": 10, "system": system}},
        {"id": "image", "prompt": "What is shown?", "image": image, "reason": {"max_new_tokens": 10}},
        {"id": "sampled", "prompt": "What is shown?", "image": image, "seed": 11,
         "reason": {"max_new_tokens": 9, "presence_penalty": 0.5, **SAMPLED}},
        {"id": "text-sampled", "prompt": "Rate it 1-5.", "seed": 3,
         "reason": {"max_new_tokens": 7, **SAMPLED}},
    ]  # fmt: skip


def _expected(ckpt, row) -> list[int]:
    """`generate`'s ids for a request line, or a sidecar's resolved request (its seed, its sample's)."""
    spec = ReasonSpec(**row["reason"])
    return reference_ids(ckpt, row["prompt"], spec, row.get("seed", 0), row.get("image"))


@pytest.fixture(scope="module")
def eos_ckpt(tiny_reasoner_ckpt, cond_image, tmp_path_factory):
    """An EOS that ends "text" early and "sampled" at another step (or never): sequences sharing passes end
    apart."""
    rows = _rows(cond_image)
    token, _ = eos_between(_expected(tiny_reasoner_ckpt, rows[0]), _expected(tiny_reasoner_ckpt, rows[2]))
    return with_eos(tiny_reasoner_ckpt, tmp_path_factory.mktemp("eos"), [token])


def test_token_ids_equal_generate_eight_sharing_passes_with_t2i(eos_ckpt, cond_image, tmp_path):
    rows = _rows(cond_image)
    rows[3]["samples"] = 5  # seeds 3..7: eight sequences in all, sharing every pass they overlap on
    prompts = write_jsonl(tmp_path / "p.jsonl", [*rows, T2I, T2V])
    _run(
        eos_ckpt, prompts, tmp_path / "out", "--max-active", "1", "--max-reason-active", "8", "--save-latents"
    )
    sidecars = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("*.json"))]
    reasoned = {s["id"]: s for s in sidecars if s.get("kind") == "reason"}
    assert len(reasoned) == 8
    stops = {}
    for rid, sidecar in reasoned.items():
        expected = _expected(eos_ckpt, sidecar["request"])
        assert sidecar["reason"]["token_ids"] == expected, rid
        assert sidecar["reason"]["generated_tokens"] == len(expected)
        stops[rid] = (sidecar["reason"]["stop_reason"], len(expected))
        assert (
            sidecar["files"]["media"]["name"] == f"{rid}.txt" and (tmp_path / "out" / f"{rid}.txt").is_file()
        )
    assert stops["text"][0] == "eos" and stops["text"][1] < 10
    assert stops["sampled"][1] != stops["text"][1]  # ended at another step, in the same passes
    assert reasoned["image"]["reason"]["vision_tokens"] > 0
    # The T2I and T2V requests beside them: their latents equal their run without reasoners.
    alone = write_jsonl(tmp_path / "alone.jsonl", [T2I, T2V])
    _run(eos_ckpt, alone, tmp_path / "alone", "--save-latents")
    for rid in ("t2i", "t2v"):
        mixed = load_file(tmp_path / "out" / f"{rid}.latents.safetensors")["latents"]
        assert mixed.equal(load_file(tmp_path / "alone" / f"{rid}.latents.safetensors")["latents"]), rid
    assert (tmp_path / "out" / "t2v.mp4").is_file()


def test_one_sequence_a_pass_and_the_outputs_and_resume(eos_ckpt, cond_image, tmp_path):
    rows = _rows(cond_image)[1:3]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    _run(eos_ckpt, prompts, tmp_path / "out", "--max-active", "1", "--max-reason-active", "1")
    for row in rows:
        sidecar = json.loads((tmp_path / "out" / f"{row['id']}.json").read_text())
        assert sidecar["reason"]["token_ids"] == _expected(eos_ckpt, row), row["id"]
        assert sidecar["reason"]["prompt_tokens"] > sidecar["reason"]["vision_tokens"] > 0
        assert sidecar["request"]["reason"]["max_new_tokens"] == row["reason"]["max_new_tokens"]
        assert {"prepare_s", "denoise_s", "write_s"} <= set(sidecar["timings"])
    with open(tmp_path / "out" / "metrics.csv") as f:
        metrics = {row["id"]: row for row in csv.DictReader(f)}
    assert {metrics[r["id"]]["kind"] for r in rows} == {"reason"}
    assert metrics["image"]["output"] == "image.txt" and metrics["image"]["status"] == "ok"
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    assert {r["kind"] for r in manifest} == {"reason"}
    again = _run(eos_ckpt, prompts, tmp_path / "out")
    assert "0 generated" in again.output and "2 already complete" in again.output


def test_bf16_as_stored_equals_generate(cond_image, tmp_path):
    """A bf16 checkpoint computes in bf16, as `from_pretrained` loads it (its stored dtype)."""
    from cosmos3_batch.model.tiny import TinySpec, write_tiny

    ckpt = write_tiny(tmp_path / "bf16", TinySpec(reasoner=True, dtype="bfloat16"))
    rows = _rows(cond_image)[:3]
    _run(ckpt, write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out")
    for row in rows:
        sidecar = json.loads((tmp_path / "out" / f"{row['id']}.json").read_text())
        assert sidecar["reason"]["token_ids"] == _expected(ckpt, row), row["id"]
