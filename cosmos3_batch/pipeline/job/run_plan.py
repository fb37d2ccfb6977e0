"""What `plan_run` hands the rest of a job: the requests to run now, the invalid and the complete ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cosmos3_batch.io.dataset import Dataset
from cosmos3_batch.requests.fields import RequestError
from cosmos3_batch.requests.parse import Request


@dataclass
class Plan:
    model_dir: Path
    requests: list[Request]  # to generate now
    invalid: list[RequestError]  # skipped with --skip-invalid
    complete: list[Request]  # already done by an earlier run (resume)
    tokenizer: object = None
    model_identity: str = ""
    dataset: Dataset = field(
        default_factory=Dataset
    )  # the format and layout the outputs are written in (io/dataset.py)
    guardrails: bool = False  # the job runs NVIDIA's guardrails (pipeline/job/screen.py)
    sizing: dict | None = None  # --max-reason-active and --und-resident as taken, and why (job/sizing.py)
