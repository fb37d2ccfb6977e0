"""The run's compute dtypes (`--dtype`, `--vae-dtype`, `--fp8-compute`): checked before anything loads, and
part of the model identity that resume compares (with the --cache settings, which change the bytes too)."""

from __future__ import annotations

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.config import RunConfig
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.loading import transformer_rule, vae_rule
from cosmos3_batch.plan.cache import cache_tag


def check_dtypes(cfg: RunConfig, checkpoint: Checkpoint) -> None:
    """`--dtype` fits the checkpoint (not FP8) and the mode (`local` streams the stored bytes)."""
    rule = transformer_rule(checkpoint, cfg.dtype)
    store = checkpoint.store("transformer")
    if cfg.offload is OffloadMode.LOCAL and any(
        rule(n, store.info(n)[0]) != store.info(n)[0] for n in store.names() if n.startswith("layers.")
    ):
        raise ValueError(
            f"--offload local streams the checkpoint's stored bytes: --dtype {cfg.dtype} would cast them "
            "(use --dtype checkpoint, or --offload allgather)"
        )


def compute_tag(cfg: RunConfig, checkpoint: Checkpoint) -> str:
    """What, beyond the checkpoint, decides an output's bytes: part of the model identity that resume
    compares, so outputs made with another compute dtype or FP8 policy are made again, not skipped."""
    tag = ""
    if checkpoint.config("transformer").get("quantization_config"):
        tag += f"+fp8-{cfg.fp8_compute}"  # the policy decides the bytes too (W8A8 steps on GPUs)
    transformer, vae = transformer_rule(checkpoint, cfg.dtype), vae_rule(checkpoint, cfg.vae_dtype)
    stored = (transformer_rule(checkpoint), vae_rule(checkpoint))
    if (transformer, vae) != stored:  # the defaults keep the identities outputs were written with
        names = [str(rule.compute).removeprefix("torch.") for rule in (transformer, vae)]
        tag += "+dtype-{}-vae-{}".format(*names)
    return tag + cache_tag(cfg.cache)  # --cache sea changes the bytes too
