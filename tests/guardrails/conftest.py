"""The guardrail tier: runs in the guardrail virtualenv only (`source scripts/env.sh guardrails`;
scripts/test.sh runs it there), on tiny guardrails built into a scratch Hugging Face cache
(tiny_guardrails.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from huggingface_hub import constants

from tests.guardrails.tiny_guardrails import build_cache


@pytest.fixture(scope="session")
def guard_cache(tmp_path_factory) -> Path:
    """The scratch cache, and this process (and what it launches) pointed at it."""
    cache = build_cache(tmp_path_factory.mktemp("hf") / "hub")
    constants.HF_HUB_CACHE = str(cache)  # already imported: the value its functions read at each call
    os.environ["HF_HUB_CACHE"] = str(cache)  # for the processes a test launches
    return cache
