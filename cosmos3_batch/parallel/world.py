"""Process-level facts: rank, world, device, process groups and their timeouts, teardown.

Groups: the main one carries start/end bookkeeping; the gather group carries only layer AllGathers,
issued by the engine's fetch worker (CPU) or comm stream (CUDA): keeping them apart means a gather in
flight never interleaves with a main-group call on the same communicator. The exchange group carries the
per-pass all-reduce of seven integers on the host: gloo always (the main group itself under gloo), so the
pass loop never waits for the device to learn who is active.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import collective_call

CPU = torch.device("cpu")

# A dead peer must reach Python as an exception (so the finisher's decoded outputs still get written and
# the survivor exits "peer rank died"), not as an abort inside ProcessGroupNCCL's watchdog thread.
# TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 = TearDown and 3 = SkipCleanUp (torch's default) kill the process
# from the watchdog with no Python exception; 2 = CleanUpOnly aborts the failed communicators and makes
# the pending and next collectives raise in the calling thread. We choose 2. torchrun's agent injects "1"
# into every worker when its own environment lacks the variable, so under torchrun "1" is read as "not
# chosen by the user"; COSMOS3_BATCH_NCCL_ERROR_HANDLING, when set, wins over both.
NCCL_ERROR_HANDLING = "2"
# Expandable segments: the finisher's side stream (VAE decode) and the compute stream would otherwise
# keep separate fixed-size segments, and a 720p/189-frame decode reserves tens of GB next to them.
# Read once, when CUDA's caching allocator starts: set before anything touches CUDA.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = CPU
    main_group: object | None = None
    gather_group: object | None = None
    exchange_group: object | None = None
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            with collective_call("a barrier"):
                dist.barrier(group=self.main_group)

    def wait_for_ranks(self, timeout_s: float, what: str) -> None:
        """A barrier with its own deadline (start-up work such as loading takes far longer than any pass):
        gloo's monitored barrier, on the host exchange group, names the ranks that did not arrive."""
        if not self.distributed:
            return
        with collective_call(f"ranks finishing {what} within --load-timeout-s {timeout_s:g}"):
            dist.monitored_barrier(group=self.exchange_group, timeout=timedelta(seconds=timeout_s))

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        with collective_call("an exchange of the ranks' records"):
            dist.all_gather_object(out, obj, group=self.main_group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (the others pass None): one collective, whose bytes do not grow with
        the world as an all-gather's do."""
        if not self.distributed:
            return obj
        box = [obj]
        with collective_call("rank 0's broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.main_group)
        return box[0]


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """'auto' takes the GPU of this rank's LOCAL_RANK when CUDA exists, else the CPU; 'cuda:N' GPU N for
    every rank of the node (ranks sharing one GPU: init_world then connects them through gloo)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {choice}: no CUDA device is visible")
    count = torch.cuda.device_count()
    if choice.startswith("cuda:"):
        index = int(choice.split(":", 1)[1])
        if index >= count:
            raise ValueError(f"--device {choice}: only {count} visible GPU(s)")
        local_rank = index
    elif local_rank >= count:
        # Two ranks on one GPU would fail later inside NCCL with a far less clear message.
        raise ValueError(f"LOCAL_RANK {local_rank} but only {count} visible GPU(s): lower --nproc-per-node")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def configure_process_env(environ: dict | None = None) -> None:
    """Process-wide settings CUDA and NCCL read once at start; only where the user has not chosen."""
    env = os.environ if environ is None else environ
    if "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF
    ours = env.get("COSMOS3_BATCH_NCCL_ERROR_HANDLING")
    current = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if ours is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = ours
    elif current is None or (current == "1" and "TORCHELASTIC_RUN_ID" in env):
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that forked it exits


def stop_with_launcher() -> None:
    """Under torchrun: SIGTERM this worker when its launcher dies (SIGKILLed, OOM-killed), so that it stops
    at the next pass like on a forwarded SIGTERM. torchrun starts workers in sessions of their own, so
    without this they would run on as orphans, writing into --out while a rerun writes there too."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not allowed here (a seccomp profile): the old behaviour, no worse
    if parent == 1 or os.getppid() != parent:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def connections_warning(env: dict | None = None) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (set for Megatron's tensor parallelism, common in NeMo images) puts
    every stream on one hardware queue: the layer copies and gathers would wait behind compute instead of
    overlapping it."""
    env = os.environ if env is None else env
    if env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return (
            "CUDA_DEVICE_MAX_CONNECTIONS=1 serializes all CUDA streams: layer fetches cannot overlap compute "
            "(unset it for this job, or set 8 or more)"
        )
    return None


def init_world(device_choice: str, timeout_s: float) -> World:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); a plain process is a world of one."""
    # First: the allocator and NCCL read these when they start (pick_device below initializes CUDA).
    configure_process_env()
    stop_with_launcher()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if device.type == "cuda" and rank == 0 and (warning := connections_warning()):
        logging.getLogger("cosmos3_batch").warning(warning)
    if world_size == 1:
        return World(device=device)
    # NCCL refuses two ranks on one GPU: ranks told to share one (--device cuda:N) talk through gloo, and the
    # engine gathers their layer parts in host memory (engine/offload.py).
    shared = device_choice.startswith("cuda:")
    backend = "nccl" if device.type == "cuda" and not shared else "gloo"
    # The timeout is what turns a dead peer into an error on the survivors instead of a hang.
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    gather_group = dist.new_group(backend=backend, timeout=timeout)
    exchange_group = (
        dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    )
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return World(
        rank, world_size, local_rank, device, dist.group.WORLD, gather_group, exchange_group, local_world_size
    )


def teardown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
        # The job's objects keep its gloo groups alive through reference cycles (measured: 6-7 native
        # threads per rank outlive a job until a collection). Free them now, while the interpreter is
        # whole: left to finalization, gloo's threads release tensors after Python is gone and the
        # process aborts ("terminate called without an active exception"; pytorch/pytorch#190489).
        gc.collect()
