"""`--upsample` and `--caption` (DESIGN.md §22) as options of `run` and `plan` (their help; the parse is
requests/chain.py `chain_defaults`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cosmos3_batch.requests.chain import DEFAULT_CAPTION_TOKENS, DEFAULT_UPSAMPLE_TOKENS

Upsample = Annotated[
    bool,
    typer.Option(
        help="Rewrite every generation request's prompt with the checkpoint's reasoner first (a line's "
        '"upsample": false opts out); sampled as NVIDIA\'s upsampler (temperature 0.7, top_p 0.8, top_k 20, '
        "presence_penalty 1.5) from the request's seed; recorded, and reused by a rerun (docs/chain.md)."
    ),
]
UpsampleTemplate = Annotated[
    Path | None,
    typer.Option(
        help="The upsampling instruction: a UTF-8 text whose {prompt}, {media}, {width}, {height}, "
        "{num_frames}, {fps}, {duration_s} are filled in per request (default: the project's own, "
        "docs/chain.md)."
    ),
]
UpsampleFormat = Annotated[
    str,
    typer.Option(
        help="json (default): the reply's first JSON object is the prompt (as NVIDIA's structured prompts); "
        "text: the reply, trimmed."
    ),
]
UpsampleFallback = Annotated[
    str,
    typer.Option(
        help="A reply that gives no prompt: fail (default) fails that request with the reason; original "
        "generates from the request's own prompt and records why."
    ),
]
UpsampleTokens = Annotated[int, typer.Option(help="Tokens the upsampler may write per prompt.")]
Caption = Annotated[
    bool,
    typer.Option(
        help="Caption every generated image or video with the reasoner, from its decoded frames (a line's "
        '"caption_instruction": false opts out, a string is its own); greedy; in the sidecar and manifest.'
    ),
]
CaptionTokens = Annotated[int, typer.Option(help="Tokens a caption or a score reply may hold.")]

DEFAULTS = (False, None, "json", "fail", DEFAULT_UPSAMPLE_TOKENS, False, DEFAULT_CAPTION_TOKENS)
