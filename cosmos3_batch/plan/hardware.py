"""The GPU figures `plan` computes with, and `plan --gpu` presets for the GPUs Cosmos3 jobs run on.

Presets are the vendors' datasheet peaks (HGX/DGX SXM parts) times what a well-tuned kernel achieves:
0.6 of dense bf16 and FP8 tensor FLOP/s, 0.8 of the host link (PCIe Gen5 x16: 64 GB/s, Gen6 on B300:
128 GB/s), 0.4 of NVLink's per-GPU bandwidth as AllGather bus bandwidth (NVLink 4: 900 GB/s, NVLink 5:
1.8 TB/s), HBM at 0.8 of its peak. docs/scale.md ("Calibration") sets the roofline against published
end-to-end times. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures. Defaults: an H100 SXM node (PCIe Gen5 host links, NVLink 4, 400G IB)."""

    h2d_gbps: float = 50.0  # achievable pinned host->device per GPU
    gather_gbps: float = 350.0  # AllGather bus bandwidth inside a node (NVLink)
    inter_node_gbps: float = 45.0  # per GPU across nodes
    tflops: float = 600.0  # achievable dense bf16 (H100 SXM peak 989, H200 the same)
    device_gib: float = 80.0  # H100 80 GB; H200: 141
    host_gib_per_node: float = 2000.0
    hbm_gbps: float = 2680.0  # achievable HBM bandwidth (H100 SXM peak 3.35 TB/s)
    fp8_tflops: float = 1190.0  # achievable dense FP8 (H100 peak 1979): W8A8 steps, docs only for now


# name: (device GiB, HBM peak GB/s, host link peak GB/s, NVLink GB/s per GPU, dense bf16 TF, dense FP8 TF)
DATASHEETS = {
    "h100": (80, 3350, 64, 900, 989, 1979),
    "h200": (141, 4800, 64, 900, 989, 1979),
    "b200": (180, 8000, 64, 1800, 2250, 4500),
    "b300": (288, 8000, 128, 1800, 2250, 4500),
}


def preset(name: str) -> Hardware:
    """`plan --gpu NAME`: the datasheet figures at the achievable shares above."""
    if name not in DATASHEETS:
        raise ValueError(f"--gpu must be one of {', '.join(DATASHEETS)}, got {name!r}")
    memory, hbm, host, nvlink, bf16, fp8 = DATASHEETS[name]
    return Hardware(
        h2d_gbps=0.8 * host,
        gather_gbps=0.4 * nvlink,
        tflops=0.6 * bf16,
        device_gib=memory,
        hbm_gbps=0.8 * hbm,
        fp8_tflops=0.6 * fp8,
    )


def with_overrides(base: Hardware, **flags: float | None) -> Hardware:
    """`base` with every flag the user gave (None: not given)."""
    return replace(base, **{k: v for k, v in flags.items() if v is not None})
