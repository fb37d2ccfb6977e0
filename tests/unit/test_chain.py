"""A dataset job end to end (issue 45, DESIGN.md §22) at world 1, bit-exact on CPU: the upsampled
prompt equals transformers' `generate` on the filled instruction with NVIDIA's upsampler sampling and the
request's seed; the generation from it equals diffusers' pipeline given that text; a caption and a score of a
generated image equal `generate` on its decoded frames; the records (sidecar, manifest, `upsampled/`), resume
reusing the recorded prompt, both fallbacks of an unparseable reply, and what is skipped and why."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.requests.chain import DEFAULT_CAPTION, DEFAULT_TEMPLATE, UpsampleSpec, fill
from cosmos3_batch.requests.parse import load_requests
from cosmos3_batch.requests.reason import ReasonSpec
from tests.conftest import write_jsonl
from tests.reasoner_reference import reference_ids
from tests.reference import reference_kwargs

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA
IMAGE = {"size": "32x32", "num_frames": 1, "num_inference_steps": 2}
UP = {"id": "up", "prompt": "a red ball rolls", **IMAGE, "seed": 5, "upsample": True}
CAP = {
    "id": "cap",
    "prompt": "a blue cube",
    **IMAGE,
    "seed": 6,
    "caption_instruction": True,
    "score_instruction": "Rate it 1-5: {prompt}",
}
PLAIN = {"id": "plain", "prompt": "a green cone", **IMAGE, "seed": 7}
STRUCTURED = {"id": "json", "prompt": '{"scene_imagination": "a yellow star"}', **IMAGE, "upsample": True}
FLAGS = ["--upsample-format", "text", "--upsample-max-new-tokens", "9", "--caption-max-new-tokens", "5"]


def _run(ckpt, prompts, out, *extra, code=0):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", "--save-latents"]
    result = CliRunner().invoke(app, [*args, *map(str, extra)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def _sidecar(out, rid):
    return json.loads((out / f"{rid}.json").read_text())


def _latents(out, rid):
    return load_file(out / f"{rid}.latents.safetensors")["latents"]


def _diffusers(ckpt, row, prompt):
    """diffusers' pipeline on the request given `prompt`: its latents."""
    (request,), _ = _requests([{k: v for k, v in row.items() if k != "upsample"}])
    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**reference_kwargs(request), "prompt": prompt}
    generator = torch.Generator("cpu").manual_seed(request.seed)
    return pipe(**kwargs, generator=generator, output_type="latent").video


def _requests(rows):
    with tempfile.TemporaryDirectory() as folder:
        return load_requests(str(write_jsonl(Path(folder) / "p.jsonl", rows)))


@pytest.fixture(scope="module")
def job(tiny_reasoner_ckpt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain")
    prompts = write_jsonl(folder / "p.jsonl", [UP, CAP, PLAIN, STRUCTURED])
    _run(tiny_reasoner_ckpt, prompts, folder / "out", *FLAGS)
    return folder, prompts, folder / "out"


def test_upsampled_prompt_equals_generate_and_its_generation_equals_diffusers(tiny_reasoner_ckpt, job):
    _, _, out = job
    record = _sidecar(out, "up")["upsample"]
    spec = UpsampleSpec(DEFAULT_TEMPLATE, "text", max_new_tokens=9)
    instruction = fill(DEFAULT_TEMPLATE, UP["prompt"], 32, 32, 1, 24.0)
    assert record["token_ids"] == reference_ids(
        tiny_reasoner_ckpt, instruction, spec.reason_spec(), UP["seed"]
    )
    assert record["status"] == "upsampled" and record["prompt_original"] == UP["prompt"]
    assert record["prompt_upsampled"] == record["reply"].strip() != UP["prompt"]
    assert record["template_sha256"] == spec.template_sha256 and record["seed"] == UP["seed"]
    assert record["sampling"] == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "presence_penalty": 1.5}  # fmt: skip
    expected = _diffusers(tiny_reasoner_ckpt, UP, record["prompt_upsampled"])
    assert torch.equal(_latents(out, "up"), expected)
    # Recorded before its generation, for a rerun; the request's record keeps the file's prompt.
    stored = json.loads((out / "upsampled" / "up.json").read_text())
    assert stored["prompt"] == record["prompt_upsampled"]
    assert stored["request_hash"] == _sidecar(out, "up")["request_hash"]
    assert _sidecar(out, "up")["request"]["prompt"] == UP["prompt"]


def test_caption_and_score_equal_generate_on_the_decoded_frames(tiny_reasoner_ckpt, job):
    _, _, out = job
    texts = _sidecar(out, "cap")["captions"]
    image = str(out / "cap.png")  # lossless: the very uint8 frames the reasoner was handed
    caption = fill(DEFAULT_CAPTION, CAP["prompt"], 32, 32, 1, 24.0)
    spec = ReasonSpec(max_new_tokens=5)
    assert texts["caption"]["token_ids"] == reference_ids(
        tiny_reasoner_ckpt, caption, spec, CAP["seed"], image
    )
    score = f"Rate it 1-5: {CAP['prompt']}"
    assert texts["score"]["token_ids"] == reference_ids(tiny_reasoner_ckpt, score, spec, CAP["seed"], image)
    assert texts["caption"]["vision_tokens"] > 0
    # The generation itself is untouched by its captions.
    assert torch.equal(_latents(out, "cap"), _diffusers(tiny_reasoner_ckpt, CAP, CAP["prompt"]))


def test_manifest_columns_and_what_is_skipped(job):
    _, _, out = job
    rows = {row["id"]: row for row in pq.read_table(out / "manifest.parquet").to_pylist()}
    up, cap = _sidecar(out, "up"), _sidecar(out, "cap")
    assert rows["up"]["prompt"] == UP["prompt"] == rows["up"]["prompt_original"]
    assert rows["up"]["prompt_upsampled"] == up["upsample"]["prompt_upsampled"]
    assert rows["cap"]["caption"] == cap["captions"]["caption"]["text"]
    assert rows["cap"]["score_text"] == cap["captions"]["score"]["text"]
    assert rows["plain"]["prompt_original"] is None and rows["plain"]["caption"] is None
    assert "upsample" not in _sidecar(out, "plain") and "captions" not in _sidecar(out, "plain")
    skipped = _sidecar(out, "json")["upsample"]
    assert skipped["status"] == "skipped" and "already structured" in skipped["reason"]
    assert skipped["prompt_upsampled"] is None and not (out / "upsampled" / "json.json").exists()


def test_rerun_reuses_the_recorded_prompt_and_a_new_template_is_a_new_request(tiny_reasoner_ckpt, job):
    folder, prompts, out = job
    result = _run(tiny_reasoner_ckpt, prompts, out, *FLAGS)
    assert "0 generated" in result.output and "4 already complete" in result.output
    # As after a kill between the upsampling and the generation: the output gone, the record kept.
    for name in ("up.json", "up.png", "up.latents.safetensors"):
        (out / name).unlink()
    record = json.loads((out / "upsampled" / "up.json").read_text())
    record["prompt"] = "a recorded prompt"  # what the rerun generates from, if it reads the record
    (out / "upsampled" / "up.json").write_text(json.dumps(record))
    _run(tiny_reasoner_ckpt, prompts, out, *FLAGS)
    again = _sidecar(out, "up")["upsample"]
    assert again["reused"] is True and again["prompt_upsampled"] == "a recorded prompt"
    assert again["token_ids"] == record["token_ids"]  # never sampled again
    assert torch.equal(_latents(out, "up"), _diffusers(tiny_reasoner_ckpt, UP, "a recorded prompt"))
    # Another template is another request: generated again, and upsampled again.
    template = folder / "mine.txt"
    template.write_text("Rewrite for {media}: {prompt}")
    result = _run(tiny_reasoner_ckpt, prompts, out, *FLAGS, "--upsample-template", template)
    assert "2 generated" in result.output  # up and json (both ask for upsampling); cap, plain complete
    changed = _sidecar(out, "up")["upsample"]
    assert "reused" not in changed and changed["template_sha256"] != again["template_sha256"]


def test_an_unparseable_reply_fails_or_falls_back_to_the_original(tiny_reasoner_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [UP, PLAIN])
    # json (the default): a random-weight reasoner writes no JSON object.
    _run(tiny_reasoner_ckpt, prompts, tmp_path / "fail", "--upsample-max-new-tokens", "6", code=1)
    summary = json.loads((tmp_path / "fail" / "summary.json").read_text())
    assert "the reply holds no JSON object" in json.dumps(summary)
    assert not (tmp_path / "fail" / "up.png").exists() and (tmp_path / "fail" / "plain.png").exists()
    out = tmp_path / "original"
    _run(
        tiny_reasoner_ckpt, prompts, out, "--upsample-max-new-tokens", "6", "--upsample-fallback", "original"
    )
    record = _sidecar(out, "up")["upsample"]
    assert record["status"] == "fallback" and record["reason"] == "the reply holds no JSON object"
    assert record["prompt_upsampled"] is None
    assert torch.equal(_latents(out, "up"), _diffusers(tiny_reasoner_ckpt, UP, UP["prompt"]))
