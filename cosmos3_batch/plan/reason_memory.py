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
from typing import TYPE_CHECKING

from cosmos3_batch.plan.branches import chain_tokens

if TYPE_CHECKING:  # the engine imports torch: the CLI reads this module's constants for its help
    from cosmos3_batch.engine.transport import OffloadMode

# Device memory neither decision hands out: the estimate sizes activations from the median request, not the
# largest, and allocators fragment. The UND half is held only if it fits in the rest; slots share the rest.
RESERVE_SHARE = 0.10
# Tokens the chat template adds around a prompt that plan's tokenizer sample did not cover (role markers,
# vision markers): with the prompt's UTF-8 bytes (a byte-level BPE token covers at least one), a bound.
CHAT_TOKENS = 32
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
    lookahead: int = 0,
) -> ReasonerSizing:
    """`flags`: (--und-resident / --no-und-resident / None, --max-reason-active / None). `device_bytes`: the
    device's memory (None: `no_figure` says why there is none). `estimate(und_resident)`: plan's device bytes
    per rank; `sequence()`: (K/V bytes, tokens) of the job's largest reasoner sequence; `lookahead`:
    --prefill-lookahead (requests prefilled ahead of a slot hold their K/V too). Both callables are called
    only when a decision needs them (a run on the CPU device computes neither). Every input is the same on
    every rank (no file is read here), so every rank decides alike."""
    usable = None if device_bytes is None else int(device_bytes * (1 - RESERVE_SHARE))
    und = _und_resident(requests, mode, flags[0], (device_bytes, usable), estimate, no_figure)
    slots = _reason_slots(
        requests, flags[1], usable, lambda: estimate(bool(und.value)), sequence, (no_figure, lookahead)
    )
    return ReasonerSizing(slots, und)


def _und_resident(requests, mode, flag, memory: tuple, estimate, no_figure: str) -> Decision:
    from cosmos3_batch.engine.transport import OffloadMode

    device_bytes, usable = memory
    if mode is OffloadMode.RESIDENT:  # a flag changes nothing there: recorded as what the run holds
        return Decision(False, "default", "--offload resident: every layer is on the device already")
    if flag is not None:
        return Decision(flag, "flag", "--und-resident" if flag else "--no-und-resident")
    if not decodes(requests):
        return Decision(False, "default", "no reasoner decoding in the job")
    if device_bytes is None:
        return Decision(False, "default", f"off on {no_figure}: the UND parts stream")
    need = estimate(True)
    fits = need <= usable
    verdict = "fits" if fits else "does not fit"
    return Decision(
        fits,
        "default",
        f"the device estimate with the UND half, {_gib(need)}, {verdict} {_gib(usable)} "
        f"({_gib(device_bytes)} less a {RESERVE_SHARE:.0%} reserve)",
    )


def _reason_slots(requests, flag, usable, estimate, sequence, context: tuple) -> Decision:
    no_figure, lookahead = context
    if flag is not None:
        return Decision(flag, "flag", "--max-reason-active")
    if usable is None:
        return Decision(CPU_REASON_SLOTS, "default", f"{CPU_REASON_SLOTS} on {no_figure}")
    if not reasoners(requests):
        return Decision(CPU_REASON_SLOTS, "default", "no reasoner requests: no reasoner slot is used")
    left = usable - estimate()
    kv, tokens = sequence()
    count = min(max((left // kv if left > 0 else 0) - lookahead, 1), MAX_REASON_SLOTS)
    return Decision(
        int(count),
        "default",
        f"{_gib(max(left, 0))} left after the device estimate and the {RESERVE_SHARE:.0%} reserve, "
        f"{kv / 2**20:,.2f} MiB of K/V per sequence ({tokens:,} tokens: prompt, vision, max_new_tokens), "
        f"less the {lookahead} prefilled ahead (--prefill-lookahead), between 1 and {MAX_REASON_SLOTS}",
    )


def sequence_kv(shape, requests, und_tokens: dict[str, int], vision: Callable) -> tuple[int, int]:
    """(K/V bytes, tokens) of the longest reasoner sequence: every layer's K and V rows (kv_heads x head_dim
    each, in the compute dtype) for its prompt (the templated count plan's estimate reads where its sample
    has the request, else a bound: `prompt_bound`), its vision tokens and its max_new_tokens."""
    tokens = max(
        (und_tokens[r.id] if r.id in und_tokens else prompt_bound(r)) + vision(r) + r.reason.max_new_tokens
        for r in reasoners(requests)
    )
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * tokens * shape.act_bytes, tokens


def prompt_bound(request) -> int:
    """At most this many tokens for a prompt plan did not tokenize: its (and its system message's) UTF-8
    bytes, plus the chat template's own tokens."""
    system = getattr(request.reason, "system", None) or ""
    return len(request.prompt.encode()) + len(system.encode()) + CHAT_TOKENS


def vision_counter(root: Path, max_vision_tokens: int) -> Callable:
    """request -> the vision tokens its K/V is sized with: an image at the checkpoint's image processor's
    pixel bound (`size.longest_edge` over (patch x merge)^2: no image can give more), a video at
    --max-vision-tokens (its frames are sampled at admission). No file is read: every rank counts alike,
    and a job of a million images does not read a million headers at its start."""
    config_path = Path(root) / "preprocessor_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    image = int(config.get("size", {}).get("longest_edge", 28 * 28 * 1280)) // factor**2

    def count(r) -> int:
        if getattr(r, "video", None) is not None:
            return max_vision_tokens
        return image if getattr(r, "image", None) is not None else 0

    return count


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
