"""What the planner estimates for a job, as plain numbers (plan/planner.py computes, plan/text.py prints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Estimate:
    world_size: int
    nnodes: int
    mode: str
    max_active: int
    slot_bytes: int  # the largest fetch slot on the device
    slots_bytes: int  # all fetch slots the engine allocates (two GEN slots and one UND slot)
    layer_bytes: int  # all layer parts, padded
    host_private_bytes_per_rank: int
    page_cache_bytes_per_node: int  # must stay cached (local mode); other modes read the files once
    device_bytes_per_rank: int
    activation_bytes_per_rank: int
    bytes_h2d_per_pass: int
    bytes_gathered_per_pass: int
    seconds_per_pass: float
    outputs_per_hour: float
    job_hours: float
    idle_share: float
    warnings: list[str]
    sp: int = 1  # --sp: ranks per sequence-parallel group
    all_to_all_bytes_per_pass: int = 0  # sent by one rank (--sp)
    all_to_all_s_per_pass: float = 0.0  # included in seconds_per_pass (on the compute stream, not overlapped)
    # Integer bytes per rank that sum to device_bytes_per_rank (docs/scale.md, "Device memory"): slots,
    # layer_weights, resident_weights, activations, batched_transient, vae_decode, runtime_overhead.
    device_breakdown: dict[str, int] = field(default_factory=dict)
    vae_tiling: bool = False
    # The largest output's VAE decode on the busiest rank (roofline seconds), at --vae-patch-parallel-size
    # `vae_parts` and, for comparison, unsplit (its bytes: device_breakdown["vae_decode"] and below).
    vae_parts: int = 1
    decode_s: float = 0.0
    decode_s_unsplit: float = 0.0
    decode_bytes_unsplit: int = 0
    # --cache sea (plan --cache-reuse): the share of branch forwards taken to reuse (seconds_per_pass counts
    # only the rest), and the share of passes guessed to skip their fetch (plan/cache.skip_share).
    cache_reuse: float = 0.0
    skipped_share: float = 0.0
    # Transfer's controls and decoded pieces kept in host memory per rank (plan/kept_memory.py); SeaCache's
    # residuals are device_breakdown["cache_residuals"].
    transfer_host_bytes_per_rank: int = 0

    def to_dict(self) -> dict:
        return asdict(self)
