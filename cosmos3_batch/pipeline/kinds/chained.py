"""The reasoner stages chained to a generation request (DESIGN.md §22), as reasoner decodes on its rank.

`UpsampleJob`: the request's prompt rewritten first. It decodes the filled instruction (requests/chain.py
`fill`, sampled as NVIDIA's upsampler, from the request's own seed); when it ends, `generation()` is the
request to generate next: the reply parsed (`parse_reply`) as its prompt, or its own prompt under
`--upsample-fallback original`, or a failure with the reason. The runner puts that request at the head of
this rank's queue, so the chain stays on its rank while the other requests use the passes.

`CaptionJob`: after a generation request's last step it takes that request's slot. The finisher thread
decodes the latents (`Finisher.hand_off`); the job sits out passes computing nothing until the frames are
there (at most `gap` passes, then it waits for them, as a Transfer chain at a chunk boundary), then asks the
reasoner each of its tasks in turn (the caption, then the score) about the decoded frames themselves, as
uint8 frames (what the encoder is handed): an image for one frame, a video with its metadata otherwise.
Greedy, like `generate` by default. When all are answered the generation request's result, with the texts,
goes to the finisher to be written.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from cosmos3_batch.model import reasoner_decode as decode
from cosmos3_batch.model.reasoner import messages
from cosmos3_batch.pipeline.kinds.denoise import RequestFailed, RequestJob, Result
from cosmos3_batch.pipeline.kinds.reason import ReasonJob
from cosmos3_batch.requests.chain import fill, parse_reply, parse_score
from cosmos3_batch.requests.parse import Request
from cosmos3_batch.requests.reason import ReasonSpec


class UpsampleJob(ReasonJob):
    """A request's prompt upsampled by the reasoner; `generation()` once done."""

    def prepare(self) -> None:
        start = time.perf_counter()
        r, spec = self.request, self.request.upsample
        instruction = fill(spec.template, r.prompt, r.width, r.height, r.num_frames, r.fps)
        prompt = decode.build_prompt(self.reasoner, self._embed, messages(instruction, None))
        self.seq = decode.start(self.reasoner, prompt, spec.reason_spec(), r.seed)
        self.tokens = prompt.input_ids.shape[1]
        self.timings["prepare_s"] = time.perf_counter() - start

    def generation(self) -> tuple[Request | None, str | None]:
        """(the request to generate, None), or (None, why this request fails)."""
        r, spec, result = self.request, self.request.upsample, self.decode()
        prompt, why = parse_reply(result.text, spec.format)
        record: dict[str, Any] = {
            "status": "upsampled" if prompt is not None else "fallback",
            "reply": result.text,
            "token_ids": list(result.token_ids),
            "generated_tokens": len(result.token_ids),
            "stop_reason": result.stop_reason,
            "seed": r.seed,
            **spec.record(),
            "upsample_s": round(self.timings["prepare_s"] + self.timings["denoise_s"], 6),
        }
        if prompt is None:
            if spec.fallback == "fail":
                return (
                    None,
                    f"upsample: {why} (--upsample-fallback original generates from the prompt as given)",
                )
            record["reason"] = why
            prompt = r.prompt
        return replace(r, prompt=prompt, prompt_original=r.prompt, upsampled=record), None


class CaptionJob(ReasonJob):
    """The caption and score of a generated request, from its decoded frames; in that request's slot."""

    def __init__(self, generated: RequestJob, frames: Future, gap: int):
        super().__init__(generated.ctx, generated.request, und_cache=generated.und_cache)
        self.generated = generated  # its report (timings, bytes, ...) is the one written
        self.frames = frames  # the finisher's decode: (Result, event or None)
        self.gap = gap  # passes sat out before waiting for the decode
        self.result: Result | None = None
        self.tasks = generated.request.captions.tasks()
        self.answers: dict[str, dict] = {}
        self.sat_out = 0
        self._started = time.perf_counter()

    @property
    def waiting(self) -> bool:
        return self.result is None

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.tasks)

    @property
    def last_step(self) -> bool:
        return False  # its end is its last task's: it hands no latents to the finisher

    def poll(self) -> None:
        """Before the exchange: the decoded frames, if ready (or once `gap` passes are sat out: waited for);
        then the first task's prefill. A decode that failed fails the request."""
        if not self.frames.done() and self.sat_out < self.gap:
            self.sat_out += 1
            return
        try:
            self.result, _ = self.frames.result()  # host frames: no device event to wait for
        except Exception as exc:
            raise RequestFailed(f"decode before its caption: {type(exc).__name__}: {exc}") from exc
        self._ask(*self.tasks[0])

    def _ask(self, name: str, instruction: str) -> None:
        from PIL import Image

        from cosmos3_batch.io.outputs import to_uint8

        frames = to_uint8(self.result.frames)
        r = self.request
        instruction = fill(instruction, r.prompt_original or r.prompt, r.width, r.height, r.num_frames, r.fps)
        if len(frames) == 1:
            chat, extra = messages(instruction, None, image=Image.fromarray(frames[0])), {}
        else:
            from transformers.video_utils import VideoMetadata

            meta = VideoMetadata(
                total_num_frames=len(frames), fps=r.fps, frames_indices=list(range(len(frames)))
            )
            chat, extra = messages(instruction, None, video=list(frames)), {"video_metadata": [meta]}
        try:
            prompt = decode.build_prompt(self.reasoner, self._embed, chat, extra)
        except (ImportError, AttributeError) as exc:  # a video without the video processor (torchvision)
            raise RequestFailed(f"{name}: cannot prepare the frames: {type(exc).__name__}: {exc}") from exc
        spec = ReasonSpec(max_new_tokens=r.captions.max_new_tokens)
        self.seq = decode.start(self.reasoner, prompt, spec, r.seed)
        self.vision_tokens = prompt.vision_tokens

    def finish_step(self) -> None:
        if self.seq is None:
            return  # sitting out: the frames are being decoded
        super().finish_step()
        if self.seq.stop_reason is None:
            return
        name = self.tasks[len(self.answers)][0]
        text = self.decode()
        answer = {"text": text.text, "token_ids": list(text.token_ids), "stop_reason": text.stop_reason}
        answer |= {"generated_tokens": len(text.token_ids), "vision_tokens": text.vision_tokens}
        if name == "score":
            answer["score"] = parse_score(text.text)
        self.answers[name] = answer
        if not self.done:
            self._ask(*self.tasks[len(self.answers)])

    def report(self) -> tuple[RequestJob, Result]:
        """The generation request and its result with the answers, for the finisher to write."""
        job = self.generated
        job.weight_bytes += self.weight_bytes
        job.stall_s += self.stall_s
        job.timings["caption_s"] = time.perf_counter() - self._started
        self.result.texts = self.answers
        return job, self.result
