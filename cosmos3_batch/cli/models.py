"""The command line's commands that write checkpoints, registered on `cli.app.app`: `make-tiny` (the
random tiny model, or with --trained the demo model) and `convert`. Parse -> call -> print, as app.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("make-tiny")(make_tiny)
    app.command()(convert)


def make_tiny(
    dir: Annotated[
        Path,
        typer.Argument(
            help="Folder to write the checkpoint to: must be new, empty or an earlier make-tiny output."
        ),
    ],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 64,
    heads: Annotated[
        int, typer.Option(help="Attention heads (head dim = hidden / heads, a multiple of 8).")
    ] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = 2,
    intermediate: Annotated[int, typer.Option(help="MLP intermediate size.")] = 128,
    dtype: Annotated[
        str, typer.Option(help="Transformer weight dtype: float32, bfloat16 or float16.")
    ] = "float32",
    vocab: Annotated[
        int | None,
        typer.Option(help="Embedding rows (default: the tokenizer's); extra rows are never-used padding."),
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Replace DIR even if it is a non-empty folder make-tiny did not write.")
    ] = False,
    sound: Annotated[
        bool, typer.Option("--sound", help="Add joint audio (a small sound tokenizer, sound_gen).")
    ] = False,
    action: Annotated[
        bool, typer.Option("--action", help="Add action_gen (every embodiment domain of the reference).")
    ] = False,
    distilled: Annotated[
        bool,
        typer.Option(
            "--distilled",
            help="A 4-step distilled checkpoint as NVIDIA ships them (modular_model_index.json with "
            "distilled_sigmas, FlowMatchEulerDiscreteScheduler, no model_index.json).",
        ),
    ] = False,
    edge: Annotated[
        bool,
        typer.Option(
            "--edge", help="The Cosmos3-Edge backbone (relu2 MLP, Nemotron norms, UND k-norm for GEN)."
        ),
    ] = False,
    reasoner: Annotated[
        bool,
        typer.Option(
            "--reasoner",
            help="Also the reasoner's files (docs/reasoner.md): a root cosmos3_omni config.json, a tiny ViT, "
            "the processor and tokenizer files with the vision special tokens.",
        ),
    ] = False,
    trained: Annotated[
        bool,
        typer.Option(
            "--trained",
            help="Write the trained demo model instead (it draws the shapes of docs/demo-model.md; weights "
            "shipped with the package, checked against their digests); the shape options do not apply.",
        ),
    ] = False,
) -> None:
    """Write a small random-weight Cosmos3 checkpoint (diffusers layout) that loads offline, or with
    --trained the demo model. Exit 2 (and nothing changed) for bad flags or a DIR that holds something
    else."""
    from cosmos3_batch.model.tiny import FolderNotOurs, TinySpec, check_replaceable, write_tiny

    if trained:
        _make_trained(dir, force)
        return

    try:
        spec = TinySpec(
            seed=seed,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            dtype=dtype,
            vocab=vocab,
            sound=sound,
            action=action,
            distilled=distilled,
            edge=edge,
            reasoner=reasoner,
        )
        if not force:
            check_replaceable(dir)
    except (ValueError, FolderNotOurs) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    path = write_tiny(dir, spec)
    typer.echo(f"wrote {path}")


def _make_trained(dir: Path, force: bool) -> None:
    from cosmos3_batch.model.demo.trained import TrainedModelError, write_trained
    from cosmos3_batch.model.tiny import FolderNotOurs, check_replaceable

    try:
        if not force:
            check_replaceable(dir)
        path = write_trained(dir)
    except (FolderNotOurs, TrainedModelError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path} (the trained demo model)")


def convert(
    src: Annotated[Path, typer.Argument(help="Source checkpoint (diffusers layout, bf16/fp16/fp32).")],
    dst: Annotated[Path, typer.Argument(help="Folder to write the converted checkpoint to (new or empty).")],
    fp8: Annotated[
        bool, typer.Option("--fp8", help="Per-tensor FP8 e4m3 layer weights + scales (ModelOpt layout).")
    ] = False,
) -> None:
    """Write DST, a converted copy of checkpoint SRC, streaming one tensor at a time (never the whole
    model in memory). Exit 2 (nothing written) for a bad SRC or a non-empty DST."""
    from cosmos3_batch.checkpoint.convert import convert_fp8
    from cosmos3_batch.checkpoint.folder import CheckpointError
    from cosmos3_batch.model.loading import decoder_linear_weights

    if not fp8:
        typer.echo("error: say which conversion: --fp8 (the only one so far)", err=True)
        raise typer.Exit(2)
    try:
        result = convert_fp8(src, dst, decoder_linear_weights)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"wrote {dst}: {result.quantized} linear weights in FP8, {result.copied} tensors copied; "
        f"transformer {result.source_bytes / 2**20:.1f} MiB -> {result.target_bytes / 2**20:.1f} MiB"
    )
