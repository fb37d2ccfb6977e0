"""Reads a diffusers-layout Cosmos3 checkpoint into the pieces the runner needs.

We do not go through `Cosmos3OmniPipeline.from_pretrained`: the transformer is built on the meta
device and filled tensor by tensor from memory-mapped safetensors, so `lm_head` is never read and
the layers can be left for the offload engine to place.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint, CheckpointError
from cosmos3_batch.checkpoint.fp8_format import quantization_config
from cosmos3_batch.checkpoint.reader import CheckpointFileError, TensorStore
from cosmos3_batch.model.dtypes import DtypeRule, apply_rule, rule_for, stored_dtype
from cosmos3_batch.model.fp8 import Fp8Compute, install_fp8, make_compute

EMBED = "embed_tokens.weight"
NEVER_LOADED = ("lm_head.",)  # generation never reads the LM head (vocab x hidden: ~1.2 GB in Nano)
# Only ever read, on the host (a lookup of a few hundred ids per prompt): a view of the node-shared page
# cache, not a private copy in every rank (1.2 GB per rank in Nano, ~10 GB per 8-GPU node).
HOST_SHARED = ("embed_tokens.weight",)


def load_tensors(
    store: TensorStore, wanted: Callable[[str], bool], shared: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """The wanted tensors, read from the mapped files: private copies (resident weights, which move to the
    device or get cast), except those named in `shared`, which stay read-only views of the map."""
    return {
        name: store.shared_tensor(name) if name in shared else store.tensor(name)
        for name in store.names()
        if wanted(name)
    }


def import_model_classes() -> None:
    """Import the classes a job's load builds (diffusers' transformer and VAE, transformers' tokenizer) at
    once: the job does so while the collector is still paused (cosmos3_batch/startup.py), not in the load's
    first calls."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def build_transformer_on_meta(
    config: dict, store: TensorStore | None = None, compute: Fp8Compute | None = None
):
    """The transformer on the meta device. With the checkpoint's `store`, an FP8 checkpoint's linears are
    `Fp8Linear`s (e4m3 weight + scale parameters, named as in the files); without it (helpers that only
    tokenize, a config-only folder) they stay ordinary linears."""
    from diffusers import Cosmos3OmniTransformer

    quantized = bool(config.get("quantization_config"))  # validated by _quantization, which callers run
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = Cosmos3OmniTransformer.from_config(config)
    del model.lm_head
    if quantized and store is not None:
        compute = compute if compute is not None else Fp8Compute()
        install_fp8(model, store, compute)
        model.fp8_compute = compute  # Cosmos3Split selects the math per sequence through it
    return model


def fill_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Assign checkpoint tensors to a meta-built module, checking every name and shape."""
    expected = dict(module.named_parameters())
    for name, tensor in tensors.items():
        param = expected.get(name)
        if param is None:
            continue  # extra tensors (lm_head, or modules this build does not have) are ignored
        if tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: tensors missing from the checkpoint: {', '.join(missing[:5])}")
    module.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False, assign=True)


def rebuild_rotary(transformer: torch.nn.Module) -> None:
    # `inv_freq` is a non-persistent buffer: on a meta build it has no values, so make it again exactly as
    # the model's own __init__ does (on the CPU, in float32).
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextRotaryEmbedding

    cfg = transformer.config
    transformer.rotary_emb = Cosmos3VLTextRotaryEmbedding(
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_axes_dim=cfg.rope_axes_dim
    )


def transformer_rule(ckpt: Checkpoint, dtype: str = "checkpoint") -> DtypeRule:
    """The transformer's `--dtype` rule (model/dtypes.py), from the headers; ValueError for FP8 + a cast."""
    from diffusers import Cosmos3OmniTransformer

    store = ckpt.store("transformer")
    stored = stored_dtype([store.info(name) for name in store.names()])
    return rule_for(Cosmos3OmniTransformer, dtype, stored, fp8=_quantization(ckpt) is not None)


def vae_rule(ckpt: Checkpoint, dtype: str = "checkpoint") -> DtypeRule:
    from diffusers import AutoencoderKLWan

    store = ckpt.store("vae")
    return rule_for(AutoencoderKLWan, dtype, stored_dtype([store.info(name) for name in store.names()]))


def load_transformer(
    ckpt: Checkpoint,
    device: torch.device,
    with_layers: bool = True,
    fp8_compute: str = "checkpoint",
    dtype: str = "checkpoint",
):
    """The transformer with all non-layer weights loaded; layers too unless the engine will place them
    (it casts them by the same rule: `transformer_rule`). An FP8 checkpoint keeps its e4m3 weights (and
    their scales) as stored; `fp8_compute` picks the math. `dtype`: `--dtype` (model/dtypes.py)."""
    config = ckpt.config("transformer")
    store = ckpt.store("transformer")
    rule = transformer_rule(ckpt, dtype)
    qc = _quantization(ckpt)
    compute = make_compute(qc, fp8_compute, device) if qc is not None else None
    model = build_transformer_on_meta(config, store, compute)

    def wanted(name: str) -> bool:
        return not name.startswith(NEVER_LOADED) and (with_layers or not name.startswith("layers."))

    tensors = load_tensors(store, wanted, HOST_SHARED)  # embed_tokens never moves to the device (below)
    where = str(ckpt.root / "transformer")
    if with_layers:
        fill_module(model, tensors, where)
    else:
        for name, child in model.named_children():
            if name != "layers":
                prefix = f"{name}."
                sub = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                fill_module(child, sub, where)
    rebuild_rotary(model)
    _place_own_parameters(model, tensors, where)
    # As diffusers' from_pretrained(dtype=...) does: every weight in the compute dtype, the time embedding
    # (`_keep_in_fp32_modules`) in float32 whatever the checkpoint stores. The token table stays as stored,
    # a shared view of the map: the rows a lookup reads are cast instead (the same values).
    skip = ("embed_tokens.",) if with_layers else ("embed_tokens.", "layers.")
    apply_rule(model, rule, skip=skip)
    model.compute_dtype = rule(EMBED, store.info(EMBED)[0])  # Cosmos3Split.dtype
    model.eval().requires_grad_(False)
    # embed_tokens stays on the host (lookups of a few hundred ids); everything else goes to the device.
    for name, child in model.named_children():
        if name not in ("embed_tokens", "layers") or (name == "layers" and with_layers):
            child.to(device)
    for name, param in list(model.named_parameters(recurse=False)):
        setattr(model, name, torch.nn.Parameter(param.to(device), requires_grad=False))
    _read_rows_by_pread(model, store, tensors)
    return model


def _read_rows_by_pread(model: torch.nn.Module, store: TensorStore, tensors: dict) -> None:
    """Token lookups read the stored rows with pread (checkpoint/reader.py RowReader), so that a checkpoint
    truncated under the job cannot turn a lookup into a SIGBUS; only where the table is the stored one."""
    table = model.embed_tokens.weight
    if EMBED in tensors and (table.dtype, tuple(table.shape)) == store.info(EMBED):
        model.embed_tokens.row_reader = store.row_reader(EMBED)


def _place_own_parameters(model: torch.nn.Module, tensors: dict, where: str) -> None:
    """Parameters the transformer holds itself rather than in a child module (the sound/action modality
    embeds), as stored: the per-child loading above does not see them."""
    for name, _ in list(model.named_parameters(recurse=False)):
        if name not in tensors:
            raise CheckpointError(f"{where}: tensors missing from the checkpoint: {name}")
        setattr(model, name, torch.nn.Parameter(tensors[name], requires_grad=False))


def validate_checkpoint(ckpt: Checkpoint) -> None:
    """Every tensor the model needs is present with the shape its config implies, and no file is
    truncated: checked from safetensors headers only, identically on every rank, before any collective."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(ckpt.config("vae"))
    _quantization(ckpt)
    transformer = build_transformer_on_meta(ckpt.config("transformer"), ckpt.store("transformer"))
    models = {"transformer": transformer, "vae": vae}
    for component, model in models.items():
        store = ckpt.store(component)
        try:
            for name, param in model.named_parameters():
                store.check(name, None, tuple(param.shape))
        except CheckpointFileError as exc:
            raise CheckpointError(str(exc)) from exc


def _quantization(ckpt: Checkpoint) -> dict | None:
    """The transformer's ModelOpt FP8 `quantization_config`, None if unquantized; a CheckpointError naming
    config.json for any other method."""
    try:
        return quantization_config(ckpt.config("transformer"), str(ckpt.root / "transformer" / "config.json"))
    except CheckpointFileError as exc:
        raise CheckpointError(str(exc)) from exc


def load_vae(ckpt: Checkpoint, device: torch.device, dtype: str = "checkpoint"):
    """The VAE, its weights cast by `--vae-dtype` (model/dtypes.py) as diffusers' from_pretrained would."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(ckpt.config("vae"))
    tensors = load_tensors(ckpt.store("vae"), lambda name: True)
    fill_module(vae, tensors, str(ckpt.root / "vae"))
    apply_rule(vae, vae_rule(ckpt, dtype))
    return vae.eval().requires_grad_(False).to(device)


LAYER_LINEAR = re.compile(r"^layers\.\d+\.")


def decoder_linear_weights(config: dict) -> set[str]:
    """Checkpoint names of the decoder layers' linear weights: what the engine moves every pass."""
    model = build_transformer_on_meta(config)
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and LAYER_LINEAR.match(name)
    }
