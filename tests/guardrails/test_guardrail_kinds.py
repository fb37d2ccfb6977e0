"""Guardrails beyond text-to-image and text-to-video (issue 46 item 6, docs/guardrails.md "Modes"):

- Transfer, where diffusers' modular pipeline checks (`Cosmos3TransferTextStep`: the prompt before anything
  runs; `Cosmos3TransferStitchStep`: the stitched frames): the same blocked prompt, the same pixelated
  frames, bit for bit.
- The reasoner, as NVIDIA's CLI checks it: its prompt before admission and its generated text after.
- The stages chained to generation: an upsampled prompt is a prompt the reference would be handed (checked
  before it is generated); a caption or a score is a reasoner reply (an unsafe one is withheld, the media
  written).

The tiny reasoner's replies are random bytes that no guardrail list can name, so where a test needs an
unsafe reply it replaces the decoded text of the named requests (`unsafe_replies`); the guardrails, the
records and the routing are the job's own.
"""

from __future__ import annotations

import dataclasses
import json

import imageio
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io.outputs import to_uint8
from cosmos3_batch.pipeline.finish import guardrail
from cosmos3_batch.pipeline.kinds.reason import ReasonJob
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import moving_square, write_jsonl
from tests.guardrails.tiny_guardrails import BLOCKED_WORD, EXACT_WORD
from tests.reference import transfer_outputs, transfer_reference

IMAGE = {"size": "32x32", "num_frames": 1, "num_inference_steps": 2}
XFER = {"prompt": "a red car", "control": {"edge": "edge.mp4"}, "size": "48x32", "num_frames": 5}
XFER |= {"num_inference_steps": 2, "guidance_scale": 3.0, "seed": 1}
FLAGS = ["--upsample-format", "text", "--upsample-max-new-tokens", "6", "--caption-max-new-tokens", "4"]
ASK = {"max_new_tokens": 4}
ROWS = [
    {"id": "ask", "prompt": "what is in the picture", "reason": ASK},
    {"id": "ask_prompt", "prompt": f"a {BLOCKED_WORD} speaks", "reason": ASK},
    {"id": "ask_reply", "prompt": "say something", "reason": ASK},
    {"id": "up", "prompt": "a lake", **IMAGE, "seed": 3, "upsample": True},
    {"id": "up_unsafe", "prompt": "a field", **IMAGE, "seed": 4, "upsample": True},
    {"id": "cap", "prompt": "a blue cube", **IMAGE, "seed": 6, "caption_instruction": True}
    | {"score_instruction": "Rate it 1-5: {prompt}"},
]
# (request id, the decoding job's class, answers so far) -> the text its decode reads as
REPLIES = {
    ("ask_reply", "ReasonJob", 0): f"the {EXACT_WORD} is here",
    ("up", "UpsampleJob", 0): "a calm lake at dawn, mist over the water",
    ("up_unsafe", "UpsampleJob", 0): f"a {BLOCKED_WORD} in a field",
    ("cap", "CaptionJob", 0): f"a {EXACT_WORD} cube",
}


def cli(ckpt, prompts, out, *flags) -> None:
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", *flags]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


def sidecar(out, rid: str) -> dict:
    return json.loads((out / f"{rid}.json").read_text())


@pytest.fixture
def unsafe_replies(monkeypatch):
    """The decoded texts of REPLIES' requests replaced (token ids and counts stay the model's)."""
    decode = ReasonJob.decode

    def replaced(self):
        result = decode(self)
        key = (self.request.id, type(self).__name__, len(getattr(self, "answers", {})))
        return dataclasses.replace(result, text=REPLIES[key]) if key in REPLIES else result

    monkeypatch.setattr(ReasonJob, "decode", replaced)


def test_reasoner_and_chained_texts_are_checked(tiny_reasoner_ckpt, guard_cache, tmp_path, unsafe_replies):
    prompts, out = write_jsonl(tmp_path / "p.jsonl", ROWS), tmp_path / "out"
    cli(tiny_reasoner_ckpt, prompts, out, "--guardrails", *FLAGS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == 3 and summary["failed"] == []
    stages = {b["id"]: sidecar(out, b["id"])["blocked"]["stage"] for b in summary["blocked"]}
    assert stages == {"ask_prompt": "prompt", "ask_reply": "reply", "up_unsafe": "upsampled prompt"}
    for rid in stages:
        assert sidecar(out, rid)["status"] == "blocked" and not list(out.glob(f"{rid}.[pt][nx][gt]"))
    assert sidecar(out, "ask_reply")["blocked"]["reason"].startswith("BLOCKLIST: ")
    assert not (out / "upsampled" / "up_unsafe.json").exists()  # never recorded for reuse
    assert (out / "ask.txt").exists() and (out / "up.png").exists() and (out / "cap.png").exists()
    upsample = sidecar(out, "up")["upsample"]
    assert upsample["prompt_upsampled"] == REPLIES[("up", "UpsampleJob", 0)]
    captions = sidecar(out, "cap")["captions"]
    assert captions["caption"]["text"] is None and captions["caption"]["token_ids"] is None
    assert captions["caption"]["blocked"].startswith("BLOCKLIST: ")
    assert captions["caption"]["generated_tokens"] == 4  # what it cost stays on record
    assert isinstance(captions["score"]["text"], str) and "blocked" not in captions["score"]
    manifest = {row["id"]: row for row in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert manifest["cap"]["caption"] is None and manifest["cap"]["score_text"] == captions["score"]["text"]
    assert {rid for rid, row in manifest.items() if row["status"] == "blocked"} == set(stages)
    cli(tiny_reasoner_ckpt, prompts, out, "--guardrails", *FLAGS)  # resume: blocked is done, not retried
    again = json.loads((out / "summary.json").read_text())
    assert (again["skipped_complete"], again["generated_ok"], again["blocked"]) == (len(ROWS), 0, [])


def test_transfer_is_checked_where_the_modular_pipeline_checks(
    tiny_reasoner_ckpt, guard_cache, tmp_path, monkeypatch
):
    imageio.mimwrite(tmp_path / "edge.mp4", moving_square(5), fps=8)
    rows = [{"id": "xfer", **XFER}, {"id": "xfer_unsafe", **XFER, "prompt": f"a {BLOCKED_WORD} car"}]
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    kept = {}
    monkeypatch.setattr(guardrail, "on_checked", lambda rid, frames: kept.setdefault(rid, frames.copy()))
    cli(tiny_reasoner_ckpt, prompts, out, "--guardrails")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == 1 and [b["id"] for b in summary["blocked"]] == ["xfer_unsafe"]
    assert (
        sidecar(out, "xfer_unsafe")["blocked"]["stage"] == "prompt" and not (out / "xfer_unsafe.mp4").exists()
    )
    requests = {r.id: r for r in load_requests(str(prompts))[0]}
    pipe = transfer_reference(tiny_reasoner_ckpt)
    pipe.enable_safety_checker()  # cosmos-guardrail's checker, on the same tiny cache
    (_, frames) = transfer_outputs(pipe, [requests["xfer"]])["xfer"]
    assert kept["xfer"].shape == (5, 32, 48, 3) and np.array_equal(kept["xfer"], to_uint8(frames))
    pipe.disable_safety_checker()
    (_, unguarded) = transfer_outputs(pipe, [requests["xfer"]])["xfer"]
    assert not np.array_equal(kept["xfer"], to_uint8(unguarded))  # faces were found and pixelated
    pipe.enable_safety_checker()
    with pytest.raises(ValueError, match="unsafe text in the prompt"):  # the reference refuses it too
        transfer_outputs(pipe, [requests["xfer_unsafe"]])
