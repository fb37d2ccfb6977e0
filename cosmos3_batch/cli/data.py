"""The command line's commands over a run's output folder (DESIGN.md §12), registered on `cli.app.app`:
`report`, `status`, `manifest`, `export lerobot`; and the `run` flags that choose the dataset format.
Parse -> call -> print, as app.py; the logic lives in io/ (report.py, status.py, manifest.py, lerobot.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

FORMAT_HELP = (
    "files: a folder of files per request; webdataset: tar shards per rank under OUT/shards/<kind>/ "
    "(image, video, video-sound, actions, reason, ...; one member set per shard), read by webdataset and HF "
    "datasets. Default: what OUT already holds, else files."
)
LAYOUT_HELP = (
    "--format files: flat (every file in OUT) or nested (OUT/<2 hex digits of a hash of the id>/). Default: "
    "what OUT already holds, else nested above 10,000 requests."
)
SHARD_SIZE_HELP = (
    "--format webdataset (given, or what OUT holds): finalize a shard at this size: bytes with a unit (1GB, "
    "512MiB; default 1GB) or a number of samples (1000)."
)
Format = Annotated[str | None, typer.Option("--format", help=FORMAT_HELP)]
Layout = Annotated[str | None, typer.Option(help=LAYOUT_HELP)]
ShardSize = Annotated[str | None, typer.Option(help=SHARD_SIZE_HELP)]
Out = Annotated[Path, typer.Argument(help="A run's --out folder (shared by the tasks of a Slurm array).")]
Inputs = Annotated[
    list[str] | None,
    typer.Option(
        "--input", help="The request file(s) of the job (as `run` takes them): adds the pending ones."
    ),
]

export_app = typer.Typer(no_args_is_help=True, help="Write a run's outputs in another dataset format.")


def register(app: typer.Typer) -> None:
    app.command()(report)
    app.command()(status)
    app.command()(manifest)
    app.add_typer(export_app, name="export")


def report(
    out: Annotated[Path, typer.Argument(help="A run's --out folder.")],
    page_size: Annotated[int, typer.Option(help="Outputs per HTML page.")] = 300,
    progress: Annotated[bool, typer.Option(help="Show a progress bar while thumbnails are made.")] = True,
) -> None:
    """Write OUT/report.html: a thumbnail, prompt and settings per output (failures with their error) and
    the run's pass timeline, occupancy, stall and bytes moved. Opens offline; pages of --page-size."""
    from cosmos3_batch.io.report import write_report

    try:
        path = write_report(out, page_size, progress)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")


def status(
    out: Out,
    input: Inputs = None,
    samples_per_prompt: Annotated[int, typer.Option(help="As `run --samples-per-prompt`.")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Done / failed / interrupted / pending (pending needs --input), per array task, outputs in the last
    hour and the ETA; with --json also each summary file's last run (passes, bytes moved, stall). Reads
    finalized files only: safe while the job runs. Exit 0: all done; 3: not yet; 2: OUT holds no run or the
    input is unreadable."""
    import json

    from cosmos3_batch.io.status import dataset_status, describe

    try:
        requests = _requests(input, samples_per_prompt)
        report = dataset_status(out, [r.id for r in requests] if requests is not None else None)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report, indent=2) if json_out else describe(report))
    raise typer.Exit(0 if report["all_done"] else 3)


def manifest(
    out: Out,
    input: Inputs = None,
    samples_per_prompt: Annotated[int, typer.Option(help="As `run --samples-per-prompt`.")] = 1,
) -> None:
    """(Re)write OUT/manifest.parquet from every rank and array task that wrote to OUT: one row per
    request (with --input, also the pending ones). Columns: docs/outputs.md."""
    from cosmos3_batch.io.manifest import write_manifest

    try:
        path, rows = write_manifest(out, _requests(input, samples_per_prompt) or ())
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}: {rows} requests")


@export_app.command("lerobot")
def lerobot(
    out: Out,
    dst: Annotated[Path, typer.Argument(help="Folder to write the LeRobot dataset to (new or empty).")],
    fps: Annotated[float, typer.Option(help="Frames (action steps) per second of the dataset.")],
    domain: Annotated[
        str | None, typer.Option(help="Only this embodiment domain (episodes must share an action width).")
    ] = None,
) -> None:
    """Policy and forward/inverse-dynamics outputs as a LeRobot v3.0 dataset: an episode per request, a row
    per action step (the predicted actions exactly as in <id>.actions.safetensors), its clip under videos/,
    its prompt as the task. Exit 2 (nothing written) for a non-empty DST or no action outputs."""
    from cosmos3_batch.io.lerobot import export_lerobot

    try:
        done = export_lerobot(out, dst, fps, domain)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {dst}: {done['episodes']} episodes, {done['frames']} frames, {done['tasks']} tasks")


def _requests(paths: list[str] | None, samples: int):
    """The validated requests of the input files (invalid lines skipped), or None without --input."""
    if not paths:
        return None
    from cosmos3_batch.requests.parse import RequestFileError, load_requests

    try:
        return load_requests(paths, skip_invalid=True, samples=samples)[0]
    except (RequestFileError, OSError) as exc:
        raise ValueError(f"--input: {exc}") from exc
