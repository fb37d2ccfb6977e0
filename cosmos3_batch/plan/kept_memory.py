"""What a job keeps between steps besides the model and the pass's activations (plan/planner.py adds it):
Transfer's controls and decoded chunk pieces in host memory, SeaCache's residuals on the device.

- A Transfer chain keeps every control preprocessed and padded to max(frames, chunk) in the transformer's
  dtype (pipeline/kinds/transfer/chunks.py prepare_controls: 1 GiB per 720p, 189-frame control in bf16) and
  its decoded chunk pieces in float32 until the stitch (2 GiB per 720p, 189-frame chain); `TRANSFER_AHEAD`
  more requests' controls are prepared ahead of admission (pipeline/kinds/transfer/inputs.py).
- With `--cache sea`, a request keeps per GEN branch its last residual_order + 1 stack residuals, and one
  stack input, each the branch's GEN stream (tokens x hidden) in the compute dtype.
A rank holds `--max-active` requests at once: the largest ones count."""

from __future__ import annotations

from cosmos3_batch.plan.branches import most_branches
from cosmos3_batch.plan.schedule import gen_tokens

TRANSFER_AHEAD = 2  # Transfer requests whose host inputs a rank prepares ahead of their admission


def _largest(values, count: int) -> int:
    return sum(sorted(values, reverse=True)[:count])


def transfer_host_bytes(requests, max_active: int, control_bytes: int, ahead: int = TRANSFER_AHEAD) -> int:
    """Host bytes per rank Transfer keeps: its `max_active` largest chains' controls and pieces, and the
    controls of the `ahead` next largest being prepared (`control_bytes`: the transformer dtype's size)."""
    chains = [r for r in requests if getattr(r, "transfer", None) is not None]

    def controls(r) -> int:
        length = max(r.num_frames, r.transfer.chunk_frames)
        return len(r.transfer.controls) * 3 * length * r.height * r.width * control_bytes

    def pieces(r) -> int:
        return 3 * r.num_frames * r.height * r.width * 4

    chains.sort(key=lambda r: controls(r) + pieces(r), reverse=True)
    held, waiting = chains[:max_active], chains[max_active : max_active + ahead]
    return sum(controls(r) + pieces(r) for r in held) + sum(map(controls, waiting))


def cache_device_bytes(requests, max_active: int, residual_order: int, hidden: int, act_bytes: int) -> int:
    """Device bytes per rank `--cache sea` keeps: residuals and stack inputs of its largest requests."""

    def kept(r) -> int:
        return (most_branches(r) * (residual_order + 1) + 1) * gen_tokens(r) * hidden * act_bytes

    return _largest(map(kept, requests), max_active)
