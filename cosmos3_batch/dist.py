"""Process-level facts: rank, world, device, process groups and their timeouts, teardown.

Groups: the main one carries start/end bookkeeping; the gather group carries only layer AllGathers,
issued by the engine's fetch worker (CPU) or comm stream (CUDA): keeping them apart means a gather in
flight never interleaves with a main-group call on the same communicator. The exchange group carries the
per-pass all-reduce of four integers on the host: gloo always (the main group itself under gloo), so the
pass loop never waits for the device to learn who is active.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = CPU
    main_group: object | None = None
    gather_group: object | None = None
    exchange_group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.main_group)

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.main_group)
        return out


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """'auto' takes the GPU of this rank's LOCAL_RANK when CUDA exists, else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    count = torch.cuda.device_count()
    if local_rank >= count:
        # Two ranks on one GPU would fail later inside NCCL with a far less clear message.
        raise ValueError(f"LOCAL_RANK {local_rank} but only {count} visible GPU(s): lower --nproc-per-node")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init_world(device_choice: str, timeout_s: float) -> World:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); a plain process is a world of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if world_size == 1:
        return World(device=device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The timeout is what turns a dead peer into an error on the survivors instead of a hang.
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    gather_group = dist.new_group(backend=backend, timeout=timeout)
    exchange_group = (
        dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    )
    return World(rank, world_size, local_rank, device, dist.group.WORLD, gather_group, exchange_group)


def teardown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
