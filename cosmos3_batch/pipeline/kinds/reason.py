"""A reasoner request (DESIGN.md §21): its decode rides the UND passes of the pass loop.

It answers the questions the runner asks every kind. While it decodes it `needs_und` (the exchange's
needs-UND flag, so every rank fetches the UND parts on that pass), it has no GEN branch (GEN parts serve it
nothing), and it `owns_parts`: the part applier hands it each UND layer part, which it runs for its tokens in
flight through transformers' decoder layer pointed at the part (model/reasoner.py). One token per pass: the
prompt's prefill on its first pass (the ViT ran once, at `prepare`), then one token each pass; `finish_step`
after the last layer draws the next token from its own generator and reads it on the host (the pass's one
sync for this sequence: the EOS check, and the next token's embedding row, read on the host as a prompt's).
EOS or `max_new_tokens` ends it; the finisher writes `<id>.txt`. The collective trace does not change: a
pass's UND fetch is decided by the same all-reduce as ever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cosmos3_batch.model import reasoner_decode as decode
from cosmos3_batch.model.cosmos3 import UND
from cosmos3_batch.model.reasoner import messages
from cosmos3_batch.pipeline.kinds.denoise import RequestFailed, RequestJob

if TYPE_CHECKING:
    from cosmos3_batch.model.reasoner import Reasoner


@dataclass
class TextResult:
    """What a reasoner request hands the finisher: its text and what it was decoded from."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    vision_tokens: int
    stop_reason: str  # "eos" | "max_new_tokens"


class ReasonJob(RequestJob):
    owns_parts = True  # the applier hands it its UND parts (passes/apply.py): it has no BranchSeq

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seq: decode.ReasonSeq | None = None
        self.vision_tokens = 0
        self.decode_passes = 0
        self.timesteps = ()  # no denoising schedule (the FP8 step policy and the trace read none)

    @property
    def reasoner(self) -> Reasoner:
        reasoner = getattr(self.ctx, "reasoner", None)
        if reasoner is None:
            raise RequestFailed("reason: the reasoner was not loaded for this job")
        return reasoner

    @property
    def done(self) -> bool:
        return self.seq is not None and self.seq.stop_reason is not None

    @property
    def last_step(self) -> bool:
        seq = self.seq
        return seq is not None and len(seq.generated) + 1 >= seq.max_new_tokens

    @property
    def needs_encode(self) -> bool:
        return False  # no VAE encode: its image or video goes through the ViT

    @property
    def needs_und(self) -> bool:
        return self.seq is not None and not self.done

    def gen_branches(self) -> list:
        return []

    def load_inputs(self) -> None:
        """Nothing to read ahead for a VAE group (this kind encodes nothing with the VAE)."""

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ctx.split.embed_text(ids, self.ctx.device)

    def prepare(self) -> None:
        start = time.perf_counter()
        r, reasoner = self.request, self.reasoner
        if r.video is not None and reasoner.processor.video_processor is None:
            raise RequestFailed(
                "reason: a video needs transformers' video processor, which needs torchvision"
            )
        image = self._load_image() if r.image is not None else None
        video, extra = self._frames() if r.video is not None else (None, {})
        chat = messages(r.prompt, r.reason.system, image=image, video=video)
        try:
            prompt = decode.build_prompt(reasoner, self._embed, chat, extra)
        except (ImportError, AttributeError) as exc:  # a video without the video processor (torchvision)
            raise RequestFailed(f"reason: cannot prepare its inputs: {type(exc).__name__}: {exc}") from exc
        self.seq = decode.start(reasoner, prompt, r.reason, r.seed)
        self.tokens = prompt.input_ids.shape[1]
        self.vision_tokens = prompt.vision_tokens
        self.timings["prepare_s"] = time.perf_counter() - start

    def _frames(self) -> tuple[list, dict]:
        """The clip's frames (decoded as V2V's are) with their metadata, and `video_fps` for the processor's
        sampling: the processor is handed decoded frames (its own fetch needs torchcodec)."""
        import imageio
        from transformers.video_utils import VideoMetadata

        frames = self._load_video()
        with imageio.get_reader(self.request.video) as reader:
            fps = float(reader.get_meta_data().get("fps", 24.0))
        metadata = VideoMetadata(
            total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames)))
        )
        extra = {"video_metadata": [metadata]}
        if self.request.reason.video_fps is not None:
            extra["fps"] = self.request.reason.video_fps
        return frames, extra

    def begin_step(self) -> None:
        if self.decode_passes == 0:
            self._denoise_started = time.perf_counter()

    def apply_part(self, layer: torch.nn.Module, index: int, part: str) -> None:
        """The applier's hand-off: a UND part runs the tokens in flight; a GEN part serves it nothing."""
        if part != UND or self.seq is None or self.done:
            return
        if index == 0 and self.seq.next_layer == 0:  # not through the stack yet (else: prefilled ahead)
            decode.begin(self.reasoner, self.seq)
        decode.apply_layer(self.reasoner, self.seq, self.reasoner.point_layer(index, layer), index)

    def finish_step(self) -> None:
        """After the pass: the next token, if the tokens in flight went through every layer."""
        seq = self.seq
        if seq.next_layer != self.ctx.split.num_layers:
            return  # a pass that fetched no UND part for it cannot happen while it needs UND; kept safe
        token = decode.next_token(self.reasoner, seq, self._embed)
        self.decode_passes += 1
        decode.stop_check(seq, int(token))  # the sync: one host read of one token id
        self.step_index = len(seq.generated)
        self.timings["denoise_s"] = time.perf_counter() - self._denoise_started

    def decode(self) -> TextResult:
        seq = self.seq
        tokenizer = self.reasoner.processor.tokenizer
        text = tokenizer.decode(seq.generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return TextResult(text, list(seq.generated), seq.prompt_length, self.vision_tokens, seq.stop_reason)
