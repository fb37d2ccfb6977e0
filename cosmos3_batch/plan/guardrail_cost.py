"""What NVIDIA's guardrails add to a job (`plan`, docs/guardrails.md): device memory per rank and time per
request, from the real models' public sizes and the GPU figures (plan/hardware.py); an estimate, not a
measurement. Torch-free.

Per rank, resident for the whole job (`CosmosSafetyChecker` on the rank's device): Qwen3Guard-Gen-0.6B
(Qwen3-0.6B's architecture, 0.44B parameters plus a 0.16B tied embedding, bf16 as stored and as transformers
loads it) and RetinaFace ResNet-50 (27.3M float32 parameters, `Resnet50_Final.pth`). Per video check, a
transient: cosmos-guardrail's RetinaFace filter moves the whole clip to the device as float32 before its
frame-by-frame detection (batch size 1), plus one frame's feature maps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cosmos3_batch.plan.hardware import GB, Hardware

QWEN3GUARD_BYTES = 596e6 * 2  # bf16
RETINAFACE_BYTES = 27.3e6 * 4  # float32
RETINAFACE_FLOP_PER_PIXEL = 2.1e5  # ResNet-50's 8.2 GFLOP at 224x224 (163k per pixel) + FPN, SSH, heads
FRAME_MAPS_BYTES_PER_PIXEL = 150  # one frame's live float32 feature maps (a layer1 bottleneck's, at 1/4 size)
FP32_SHARE = 0.5  # RetinaFace runs in float32 (TF32 convolutions): about half the bf16 tensor rate
GUARD_PROMPT_TOKENS = 600  # Qwen3Guard's chat template (its policy and categories) with a prompt
GUARD_REPLY_TOKENS = 12  # "Safety: Safe\nCategories: None" and its end token
DECODE_STEP_S = 0.015  # one step of transformers' eager generate over 28 layers: kernel launches, not HBM
FRAME_HOST_S = 0.002  # per frame: box decode, NMS and pixelation on the host, and the frame's sync


@dataclass(frozen=True)
class GuardrailCost:
    resident_gib: float  # per rank, the whole job
    video_peak_gib: float  # the largest request's video check, on the finisher's stream
    text_s: float  # per request, before admission
    video_s: float  # per request on average, at the finish

    def to_dict(self) -> dict:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def guardrail_cost(requests: list, hw: Hardware) -> GuardrailCost:
    """`requests`: objects with width, height, num_frames (the job's)."""
    flops = hw.tflops * 1e12
    prefill = 2 * QWEN3GUARD_BYTES / 2 * GUARD_PROMPT_TOKENS / flops
    step = max(DECODE_STEP_S, QWEN3GUARD_BYTES / (hw.hbm_gbps * GB))
    pixels = [(r.width * r.height, r.num_frames) for r in requests] or [(0, 0)]
    frame_s = [p * RETINAFACE_FLOP_PER_PIXEL / (flops * FP32_SHARE) + FRAME_HOST_S for p, _ in pixels]
    video_s = sum(s * t for s, (_, t) in zip(frame_s, pixels, strict=True)) / len(pixels)
    peak = max(p * t * 3 * 4 + p * FRAME_MAPS_BYTES_PER_PIXEL for p, t in pixels)
    return GuardrailCost(
        resident_gib=(QWEN3GUARD_BYTES + RETINAFACE_BYTES) / 2**30,
        video_peak_gib=peak / 2**30,
        text_s=prefill + GUARD_REPLY_TOKENS * step,
        video_s=video_s,
    )


def describe(cost: GuardrailCost) -> str:
    return (
        "guardrails (cosmos-guardrail, estimated from the models' sizes): "
        f"{cost.resident_gib:.2f} GiB per rank resident (Qwen3Guard-Gen-0.6B bf16, RetinaFace ResNet-50), "
        f"up to {cost.video_peak_gib:.2f} GiB more while a video is checked; "
        f"{cost.text_s:.2f} s per request for the prompt (before admission, no pass waits) and "
        f"{cost.video_s:.2f} s per request for the frames (on the finisher thread)"
    )
