"""Process-wide CUDA/NCCL settings chosen in dist.configure_process_env: set only where the user has not."""

from __future__ import annotations

import pytest

from cosmos3_batch.parallel.world import DEFAULT_ALLOC_CONF, NCCL_ERROR_HANDLING, configure_process_env

NCCL = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOC_CONF, NCCL: NCCL_ERROR_HANDLING}),
        # The user's allocator settings, under either name, are left alone (and not shadowed by ours).
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
        ),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_CUDA_ALLOC_CONF": None}),
        # Outside torchrun a "1" is the user's; under torchrun it is what the agent injects when unset.
        ({NCCL: "1"}, {NCCL: "1"}),
        ({NCCL: "1", "TORCHELASTIC_RUN_ID": "x"}, {NCCL: NCCL_ERROR_HANDLING}),
        ({NCCL: "3", "TORCHELASTIC_RUN_ID": "x"}, {NCCL: "3"}),
        ({NCCL: "1", "TORCHELASTIC_RUN_ID": "x", "COSMOS3_BATCH_NCCL_ERROR_HANDLING": "1"}, {NCCL: "1"}),
    ],
)
def test_settings_are_ours_only_where_unset(given, expected):
    env = dict(given)
    configure_process_env(env)
    for key, value in expected.items():
        assert env.get(key) == value, key
