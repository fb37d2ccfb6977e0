"""A request's `extra_params.guardrails` against the job's setting (docs/guardrails.md): only a restatement.

Guardrails are a job setting (`run --guardrails` / `--no-guardrails`): a request cannot turn them on for
itself (it would run without the checks it asked for), nor off (that is `--no-guardrails`, on record).
"""

from __future__ import annotations


def guardrails_mismatch(asked: bool, job: bool) -> str | None:
    """Why a request's `guardrails` does not fit a job that runs them (`job`) or not; None when it does."""
    if asked and not job:
        return (
            "this job runs without guardrails (--no-guardrails, or a built-in tiny model's default): run it "
            "with --guardrails, or remove the field; a request is never run without the checks it asked for"
        )
    if job and not asked:
        return (
            "this job runs NVIDIA's guardrails on every request: one request cannot turn them off "
            "(run the job with --no-guardrails, which summary.json and every sidecar record)"
        )
    return None
