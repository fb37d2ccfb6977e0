"""The reasoner stages chained to a generation request (DESIGN.md §22): `upsample` rewrites its prompt
before generation, `caption_instruction` and `score_instruction` describe and rate what was generated (not
`caption`/`score`: a dataset table's `caption` column is its prompt). Checked here like every other
field (line and field named); the job's flags (--upsample, --caption) set the default a line may override.
No torch here.

The instruction the upsampler is given is a template with named fields filled in (`fill`); the project's own
is `DEFAULT_TEMPLATE`, `--upsample-template FILE` replaces it. Its sha256 is part of the request's record,
so a changed template (or any sampling setting) makes a different request, generated again.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from cosmos3_batch.requests.fields import _ABSENT, LineErrors, _check_text, _get, describe
from cosmos3_batch.requests.reason import ReasonSpec

CHAIN_KEYS = ("upsample", "caption_instruction", "score_instruction")
FORMATS = ("json", "text")
FALLBACKS = ("fail", "original")
# NVIDIA's upsampler samples (its inference CLI's prompt_upsampler defaults); our seed is the request's own.
UPSAMPLE_SAMPLING = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "presence_penalty": 1.5,
}
DEFAULT_UPSAMPLE_TOKENS = 1024
DEFAULT_CAPTION_TOKENS = 256
DEFAULT_TEMPLATE = """\
You write prompts for a video and image generation model. Rewrite the short description below into a \
detailed prompt for {media}.

Reply with one JSON object and nothing else, with exactly these keys:
- "scene_imagination": the setting, the subjects and their appearance, lighting, camera and style, in a few \
concrete sentences;
- "temporal_caption": what happens over time, in order, from the first frame to the last (for an image: the \
single moment shown);
- "audio_description": the sounds one would hear (for an image or a silent clip: "none").

Keep every fact of the description; add only details that fit it.

Description: {prompt}"""
DEFAULT_CAPTION = (
    "Describe this {media} in detail: the setting, the subjects, what they do and how the camera moves."
)
# The fields a template may name; any other text in braces (a JSON example, say) is left as it is.
FIELDS = ("prompt", "media", "width", "height", "num_frames", "fps", "duration_s")
_FIELD = re.compile(r"\{(" + "|".join(FIELDS) + r")\}")


@dataclass(frozen=True)
class UpsampleSpec:
    """How a request's prompt is rewritten: the instruction, the reply's format, what a bad reply does."""

    template: str  # the instruction, fields unfilled (recorded by its sha256 only)
    format: str = "json"  # json: the reply's JSON object is the prompt; text: the reply, trimmed
    fallback: str = "fail"  # fail: the request fails; original: it runs on its own prompt, recorded so
    max_new_tokens: int = DEFAULT_UPSAMPLE_TOKENS

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def reason_spec(self) -> ReasonSpec:
        return ReasonSpec(max_new_tokens=self.max_new_tokens, **UPSAMPLE_SAMPLING)

    def record(self) -> dict[str, Any]:
        """What the request's record (and so its hash) holds of it: the template by its digest."""
        return {
            "template_sha256": self.template_sha256,
            "format": self.format,
            "fallback": self.fallback,
            "max_new_tokens": self.max_new_tokens,
            "sampling": dict(UPSAMPLE_SAMPLING),
        }


@dataclass(frozen=True)
class CaptionSpec:
    """What the reasoner is asked about the generated frames, after decode: greedy, as `generate` is."""

    caption: str | None = None  # the captioning instruction (None: no caption)
    score: str | None = None  # the scoring instruction (None: no score)
    max_new_tokens: int = DEFAULT_CAPTION_TOKENS  # each of the two

    def tasks(self) -> list[tuple[str, str]]:
        """(name, instruction) in the order they run: the caption, then the score."""
        return [(name, text) for name, text in (("caption", self.caption), ("score", self.score)) if text]


@dataclass(frozen=True)
class ChainDefaults:
    """The job's flags: what a line that says nothing about upsample / caption gets."""

    upsample: UpsampleSpec | None = None  # --upsample-template/-format/-fallback/-max-new-tokens
    upsample_all: bool = False  # --upsample
    caption: str | None = None  # --caption: every generation request is captioned with this instruction
    caption_tokens: int = DEFAULT_CAPTION_TOKENS  # --caption-max-new-tokens (captions and scores)


def media_words(width: int, height: int, num_frames: int, fps: float) -> str:
    """The request's output in words, for a template's {media}."""
    if num_frames == 1:
        return f"an image of {width}x{height} pixels"
    return f"a {num_frames / fps:.1f}-second video of {width}x{height} pixels at {fps:g} frames per second"


def fill(template: str, prompt: str, width: int, height: int, num_frames: int, fps: float) -> str:
    """The instruction with the request's fields in place of {prompt}, {media}, {width}, ... ."""
    values = {
        "prompt": prompt,
        "media": media_words(width, height, num_frames, fps),
        "width": str(width),
        "height": str(height),
        "num_frames": str(num_frames),
        "fps": f"{fps:g}",
        "duration_s": f"{num_frames / fps:.1f}",
    }
    return _FIELD.sub(lambda match: values[match.group(1)], template)


def _flag(out: LineErrors, key: str, value: Any) -> bool | None:
    if not isinstance(value, bool):
        out.add(key, f"must be true or false, got {describe(value)}")
        return None
    return value


def check_chain(out: LineErrors, obj: dict[str, Any], defaults: ChainDefaults, reasoner_missing) -> dict:
    """The fields `upsample`, `caption_instruction`, `score_instruction` of a generation line (a
    reasoner line refuses them as generation fields: requests/reason.py). A line's own value wins
    over the job's flag."""
    upsample = _get(obj, "upsample")
    wanted = defaults.upsample_all if upsample is _ABSENT else _flag(out, "upsample", upsample)
    caption = _get(obj, "caption_instruction")
    if caption is _ABSENT:
        instruction = defaults.caption
    elif isinstance(caption, bool):
        instruction = DEFAULT_CAPTION if caption else None
    elif (instruction := _check_text(out, "caption_instruction", caption)) is not None and not (
        instruction.strip()
    ):
        out.add("caption_instruction", "must be true, false or a non-empty instruction")
    score = _get(obj, "score_instruction")
    if score is not _ABSENT:
        score = _check_text(out, "score_instruction", score)
    if isinstance(score, str) and not score.strip():
        out.add(
            "score_instruction",
            "must be a non-empty instruction (e.g. 'Rate the physical plausibility 1-5.')",
        )
    score = None if score is _ABSENT else score
    named = (("upsample", wanted), ("caption_instruction", instruction), ("score_instruction", score))
    asked = [key for key, on in named if on]
    if asked and reasoner_missing:
        missing = "; ".join(reasoner_missing)
        out.add(
            asked[0], f"needs the checkpoint's reasoner, which it lacks: {missing} (make-tiny --reasoner)"
        )
    if _get(obj, "action") is not _ABSENT and (instruction or score):
        out.add(
            "caption_instruction" if instruction else "score_instruction",
            "an action request's output is its actions, not media",
        )
    spec = defaults.upsample if wanted else None
    if wanted and spec is None:
        spec = UpsampleSpec(DEFAULT_TEMPLATE)
    captions = CaptionSpec(instruction, score, defaults.caption_tokens) if instruction or score else None
    return {"upsample": spec, "captions": captions}


def parse_reply(reply: str, form: str) -> tuple[str | None, str | None]:
    """(the prompt the reply gives, None) or (None, why it gives none). `json`: the first JSON object in
    the reply (text around it, a code fence say, is dropped), non-empty, written back compactly with
    `json.dumps` (ensure_ascii off: the text as the model wrote it); `text`: the reply, trimmed."""
    text = reply.strip()
    if not text:
        return None, "the reply is empty"
    if form == "text":
        return text, None
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict) and value:
            return json.dumps(value, ensure_ascii=False), None
    return None, "the reply holds no JSON object"


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(reply: str) -> float | None:
    """The first number in the reply (an integer or a decimal, signed), or None: "4/5" is 4, "Score: 3.5" is
    3.5 (NVIDIA's own parser takes the first digit: the same for its 1-5 replies)."""
    match = _NUMBER.search(reply)
    return None if match is None else float(match.group())


def skip_reason(prompt: str, action: bool) -> str | None:
    """Why a request asking for upsampling keeps its prompt (NVIDIA's upsampler skips the same two)."""
    if action:
        return "an action mode: its prompt is an instruction, not a scene"
    if prompt.lstrip().startswith("{"):
        try:
            if isinstance(json.loads(prompt), dict):
                return "the prompt is already structured (a JSON object)"
        except ValueError:
            pass
    return None


def chain_defaults(
    upsample: bool,
    template: str | None,
    form: str,
    fallback: str,
    upsample_tokens: int,
    caption: bool,
    caption_tokens: int,
) -> ChainDefaults:
    """The job's --upsample* / --caption* flags (template: the file's text); ValueError names a bad one."""
    if form not in FORMATS:
        raise ValueError(f"--upsample-format must be one of {', '.join(FORMATS)}, got {form!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"--upsample-fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    for flag, value in (
        ("--upsample-max-new-tokens", upsample_tokens),
        ("--caption-max-new-tokens", caption_tokens),
    ):
        if not 1 <= value <= 65536:
            raise ValueError(f"{flag} must be >= 1 and <= 65536, got {value}")
    if template is not None and "{prompt}" not in template:
        raise ValueError(
            "--upsample-template: the instruction names no {prompt}: the request's prompt would be lost"
        )
    spec = UpsampleSpec(DEFAULT_TEMPLATE if template is None else template, form, fallback, upsample_tokens)
    return ChainDefaults(spec, upsample, DEFAULT_CAPTION if caption else None, caption_tokens)
