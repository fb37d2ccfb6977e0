"""A reasoner request's files (DESIGN.md §21): `<id>.txt` (the generated text, UTF-8, as the tokenizer decodes
it without special tokens) and what its sidecar says about the decode."""

from __future__ import annotations

from pathlib import Path

from cosmos3_batch.io.outputs import atomic_write


def write_text(path: Path, text: str) -> int:
    data = text.encode("utf-8")
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def reason_facts(result) -> dict:
    """The sidecar's `reason` record: token counts and why the decode stopped."""
    return {
        "reason": {
            "prompt_tokens": result.prompt_tokens,
            "vision_tokens": result.vision_tokens,
            "generated_tokens": len(result.token_ids),
            "token_ids": list(result.token_ids),
            "stop_reason": result.stop_reason,
        }
    }
