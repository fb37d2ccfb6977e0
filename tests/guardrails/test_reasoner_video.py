"""Video into the reasoner (issue 44 item 4, issue 45 item 2), in this tier because transformers' Qwen3-VL
video processor needs torchvision, which only this virtualenv has (README "Tests"; `.venv` has none and a
video request fails alone there, saying so).

- A reasoner request with a `video`: the token ids equal `generate` on the same frames, handed to the
  processor with their metadata (greedy, and sampled at `video_fps`).
- A caption of a generated video: the ids equal `generate` on the decoded frames themselves (the uint8 frames
  the writer encodes, before any encoding: diffusers' pipeline gives the same frames, compared first).
"""

from __future__ import annotations

import json

import imageio
import numpy as np
import torch
from diffusers import Cosmos3OmniPipeline
from transformers.video_utils import VideoMetadata
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io.outputs import to_uint8
from cosmos3_batch.requests.chain import DEFAULT_CAPTION, fill
from cosmos3_batch.requests.parse import load_requests
from cosmos3_batch.requests.reason import ReasonSpec
from tests.conftest import moving_square, write_jsonl
from tests.reasoner_reference import reference_ids
from tests.reference import reference_kwargs

FPS = 8.0
SAMPLED = {"do_sample": True, "top_k": 20, "temperature": 0.8, "top_p": 0.9}
CLIP = {"id": "clip", "prompt": "a square moves", "size": "48x32", "num_frames": 5, "fps": 8}
CLIP |= {"num_inference_steps": 2, "seed": 4, "caption_instruction": True}


def _run(ckpt, prompts, out, *extra):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", *extra]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json") if p.stem != "summary"}


def _clip(path, count: int = 16):
    """A clip of a square moving right, written as a user's MP4 is; its frames as decoded (RGB uint8)."""
    imageio.mimwrite(path, moving_square(count, 64, 64, step=4), fps=FPS, macro_block_size=1)
    with imageio.get_reader(path) as reader:
        return [np.asarray(frame) for frame in reader]


def test_a_video_request_equals_generate_on_its_frames(tiny_reasoner_ckpt, tmp_path):
    frames = _clip(tmp_path / "clip.mp4")
    rows = [
        {"id": "greedy", "prompt": "What moves?", "video": "clip.mp4", "reason": {"max_new_tokens": 8}},
        {"id": "sampled", "prompt": "Describe it.", "video": "clip.mp4", "seed": 9,
         "reason": {"max_new_tokens": 7, "video_fps": 4, **SAMPLED}},
    ]  # fmt: skip
    sidecars = _run(tiny_reasoner_ckpt, write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out")
    metadata = VideoMetadata(total_num_frames=len(frames), fps=FPS, frames_indices=list(range(len(frames))))
    for row in rows:
        spec = ReasonSpec(**row["reason"])
        video = (frames, metadata, spec.video_fps)
        expected = reference_ids(tiny_reasoner_ckpt, row["prompt"], spec, row.get("seed", 0), video=video)
        reason = sidecars[row["id"]]["reason"]
        assert reason["token_ids"] == expected, row["id"]
        assert reason["vision_tokens"] > 0
    # The 2 s clip sampled at 4 fps keeps twice the frames of the processor's default 2 fps: more tokens.
    assert sidecars["sampled"]["reason"]["vision_tokens"] > sidecars["greedy"]["reason"]["vision_tokens"]


def test_a_caption_of_a_generated_video_equals_generate_on_its_decoded_frames(tiny_reasoner_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [CLIP])
    sidecar = _run(tiny_reasoner_ckpt, prompts, tmp_path / "out", "--caption-max-new-tokens", "6")["clip"]
    (request,), _ = load_requests(str(prompts))
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_reasoner_ckpt)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(request.seed)
    decoded = pipe(**reference_kwargs(request), generator=generator, output_type="np").video
    frames = list(to_uint8(decoded))  # what the writer encodes, and what the reasoner is handed
    assert len(frames) == 5
    metadata = VideoMetadata(total_num_frames=5, fps=request.fps, frames_indices=list(range(5)))
    instruction = fill(DEFAULT_CAPTION, request.prompt, 48, 32, 5, request.fps)
    spec = ReasonSpec(max_new_tokens=6)
    video = (frames, metadata, None)
    expected = reference_ids(tiny_reasoner_ckpt, instruction, spec, request.seed, video=video)
    caption = sidecar["captions"]["caption"]
    assert caption["token_ids"] == expected and caption["vision_tokens"] > 0
