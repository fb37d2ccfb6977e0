"""Process-level facts: which device this rank drives."""

from __future__ import annotations

import os

import torch


def pick_device(choice: str) -> torch.device:
    """'auto' takes the GPU of this rank's LOCAL_RANK when CUDA exists, else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
