"""Upsampled prompts on disk (DESIGN.md §22): `<out>/upsampled/<id>.json`, written as soon as the reasoner has
rewritten a prompt, before its generation starts. A rerun generates from the recorded prompt instead of
sampling it again; the record counts only for the very request (its hash: prompt, upsample settings and the
template's sha256 included) on the very model (its digest). Fields: docs/outputs.md."""

from __future__ import annotations

import json
from pathlib import Path

from cosmos3_batch.io.outputs import write_json

FOLDER = "upsampled"


class UpsampleStore:
    def __init__(self, out: Path, model_digest: str):
        self.folder = Path(out) / FOLDER
        self.model_digest = model_digest

    def path(self, request_id: str) -> Path:
        return self.folder / f"{request_id}.json"

    def write(
        self, request_id: str, request_hash: str, prompt_original: str, prompt: str, record: dict
    ) -> None:
        self.folder.mkdir(exist_ok=True)
        fields = {"id": request_id, "request_hash": request_hash, "model_digest": self.model_digest}
        write_json(
            self.path(request_id), {**fields, "prompt_original": prompt_original, "prompt": prompt, **record}
        )

    def read(self, request_id: str, request_hash: str) -> dict | None:
        """The record of this request on this model, or None (none, another request's, unreadable)."""
        try:
            record = json.loads(self.path(request_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict):
            return None
        if record.get("request_hash") != request_hash or record.get("model_digest") != self.model_digest:
            return None
        return record if isinstance(record.get("prompt"), str) else None
