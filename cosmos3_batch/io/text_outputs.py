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


def chain_facts(request, texts: dict | None) -> dict:
    """The sidecar's records of the reasoner stages chained to a generation request (DESIGN.md §22):
    `upsample` (what became of its prompt: status upsampled / fallback / skipped, the reply, the template's
    sha256, the sampling settings, the seed; `reused` when a rerun took the recorded prompt) and `captions`
    (each task's text, token count and stop reason; the score's parsed number)."""
    facts: dict = {}
    if request.upsampled is not None:
        rewritten = request.upsampled.get("status") == "upsampled"
        facts["upsample"] = {
            **request.upsampled,
            "prompt_original": request.prompt_original,
            "prompt_upsampled": request.prompt if rewritten else None,
        }
    if texts:
        facts["captions"] = texts
    return facts


def chain_members(sidecar: dict) -> dict[str, str]:
    """A WebDataset sample's members for its chained texts (suffix -> UTF-8 text): `prompt_upsampled.txt`,
    `caption.txt`, `score.txt` (the reply; its number is in the `.json`), each only where there is one."""
    upsample, texts = sidecar.get("upsample") or {}, sidecar.get("captions") or {}
    members = {"prompt_upsampled.txt": upsample.get("prompt_upsampled")}
    members |= {f"{name}.txt": (texts.get(name) or {}).get("text") for name in ("caption", "score")}
    return {suffix: text for suffix, text in members.items() if text is not None}
