"""What the reasoner takes of device memory, decided when the flags leave it to the job (DESIGN.md §21):
how many reasoner sequences share a rank's passes (--max-reason-active) and whether every layer's UND half
stays on the device (--und-resident). `plan` and `run` call the same `size_reasoner`, `run` on every rank
from inputs every rank holds alike (the flags, the requests, the checkpoint's shape, one device memory
figure: on CUDA the device's total memory, the smallest over the ranks, carried by a gather the start
already makes), so every rank takes the same decision with no collective of its own. The UND half's
residency changes the engine's layout, whose digest the ranks compare at load.

Residency first (the larger win: 0 UND bytes per generated token), then the reasoner slots from what is
left: the device memory less plan's device estimate (with the UND half if it stays), over the K/V one
sequence keeps (every layer's K and V for its prompt, vision and new tokens), between 1 and
MAX_REASON_SLOTS. On the CPU device there is no memory figure to size from: the UND half streams (the CPU
tests' behaviour) and the reasoner slots are CPU_REASON_SLOTS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.plan.branches import chain_tokens

CPU_REASON_SLOTS = 8  # --max-reason-active on the CPU device (and where no model is known to size from)
MAX_REASON_SLOTS = 64  # the most the default takes: past it one UND fetch is shared thinly enough already
CPU_DEVICE = "the CPU device (no device memory to size from)"


@dataclass(frozen=True)
class Decision:
    value: int | bool
    chosen_by: str  # "flag" (the user's) or "default" (decided here)
    why: str

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReasonerSizing:
    max_reason_active: Decision
    und_resident: Decision

    def record(self) -> dict:
        return {
            "max_reason_active": self.max_reason_active.record(),
            "und_resident": self.und_resident.record(),
        }

    @property
    def values(self) -> tuple[bool, int]:
        """(--und-resident, --max-reason-active) as taken."""
        return bool(self.und_resident.value), int(self.max_reason_active.value)


def reasoners(requests) -> list:
    """The reasoner requests (each takes a reasoner slot); chained stages ride their request's slot."""
    return [r for r in requests if getattr(r, "reason", None) is not None]


def decodes(requests) -> bool:
    """Some request decodes with the reasoner: a reasoner request, an upsampling, a caption or a score."""
    return bool(reasoners(requests)) or any(any(chain_tokens(r)) for r in requests)


def size_reasoner(
    requests,
    mode: OffloadMode,
    flags: tuple[bool | None, int | None],
    device_bytes: int | None,
    estimate: Callable[[bool], int],
    sequence: Callable[[], tuple[int, int]],
    no_figure: str = CPU_DEVICE,
) -> ReasonerSizing:
    """`flags`: (--und-resident / --no-und-resident / None, --max-reason-active / None). `device_bytes`: the
    device's memory (None: `no_figure` says why there is none). `estimate(und_resident)`: plan's device bytes
    per rank; `sequence()`: (K/V bytes, tokens) of the job's largest reasoner sequence. Both are called only
    when a decision needs them (a run on the CPU device computes neither)."""
    und = _und_resident(requests, mode, flags[0], device_bytes, estimate, no_figure)
    slots = _reason_slots(
        requests, flags[1], device_bytes, lambda: estimate(bool(und.value)), sequence, no_figure
    )
    return ReasonerSizing(slots, und)


def _und_resident(requests, mode, flag, device_bytes, estimate, no_figure: str) -> Decision:
    if flag is not None:
        return Decision(flag, "flag", "--und-resident" if flag else "--no-und-resident")
    if mode is OffloadMode.RESIDENT:
        return Decision(False, "default", "--offload resident: every layer is on the device already")
    if not decodes(requests):
        return Decision(False, "default", "no reasoner decoding in the job")
    if device_bytes is None:
        return Decision(False, "default", f"off on {no_figure}: the UND parts stream")
    need = estimate(True)
    fits = need <= device_bytes
    verdict = "fits" if fits else "does not fit"
    return Decision(
        fits,
        "default",
        f"the device estimate with the UND half, {_gib(need)}, {verdict} {_gib(device_bytes)}",
    )


def _reason_slots(requests, flag, device_bytes, estimate, sequence, no_figure: str) -> Decision:
    if flag is not None:
        return Decision(flag, "flag", "--max-reason-active")
    if device_bytes is None:
        return Decision(CPU_REASON_SLOTS, "default", f"{CPU_REASON_SLOTS} on {no_figure}")
    if not reasoners(requests):
        return Decision(CPU_REASON_SLOTS, "default", "no reasoner requests: no reasoner slot is used")
    left = device_bytes - estimate()
    kv, tokens = sequence()
    count = min(max(left // kv if left > 0 else 0, 1), MAX_REASON_SLOTS)
    return Decision(
        int(count),
        "default",
        f"{_gib(max(left, 0))} left after the device estimate, {kv / 2**20:,.2f} MiB of K/V per sequence "
        f"({tokens:,} tokens: prompt, vision, max_new_tokens), between 1 and {MAX_REASON_SLOTS}",
    )


def sequence_kv(shape, requests, und_tokens: dict[str, int], vision: Callable) -> tuple[int, int]:
    """(K/V bytes, tokens) of the longest reasoner sequence: every layer's K and V rows (kv_heads x head_dim
    each, in the compute dtype) for its prompt (the templated count plan's estimate reads), its vision
    tokens and its max_new_tokens."""
    tokens = max(und_tokens.get(r.id, 0) + vision(r) + r.reason.max_new_tokens for r in reasoners(requests))
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * tokens * shape.act_bytes, tokens


def vision_counter(root: Path, max_vision_tokens: int) -> Callable:
    """request -> its vision tokens as the checkpoint's image processor makes them: the image resized to
    multiples of patch x merge between the processor's pixel bounds (transformers' `smart_resize`, from the
    image file's header), one token a merged patch. A video's frames are sampled at admission: counted at
    --max-vision-tokens."""
    config_path = Path(root) / "preprocessor_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    def count(r) -> int:
        if getattr(r, "video", None) is not None:
            return max_vision_tokens
        if getattr(r, "image", None) is None:
            return 0
        return image_tokens(r.image, config)

    return count


def image_tokens(path, config: dict) -> int:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    size = config.get("size", {})
    most = size.get("longest_edge", 28 * 28 * 1280)
    try:
        with Image.open(path) as image:  # the header only: no pixel is decoded
            width, height = image.size
    except (OSError, ValueError):  # unreadable: its admission fails it; sized at the processor's bound
        return most // factor**2
    height, width = smart_resize(height, width, factor, size.get("shortest_edge", 56 * 56), most)
    return (height // factor) * (width // factor)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
