"""Command line: parse -> config -> call. No logic lives here."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

import cosmos3_batch.cli.cache as cli_cache
import cosmos3_batch.cli.chain as cli_chain
import cosmos3_batch.cli.data as cli_data
import cosmos3_batch.cli.models as cli_models
import cosmos3_batch.cli.reasoner as cli_reasoner
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.row_budget import MAX_BATCH_ROWS
from cosmos3_batch.startup import imports_done

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Batch image/video generation with Cosmos3 (launch with torchrun for several GPUs).",
)


@app.callback()
def _start(ctx: typer.Context) -> None:
    # Every command but `run` collects garbage as usual from here; `run` once its job has validated, planned
    # and imported what its load builds (pipeline/job/run.py; startup.py: the collector paused at entry).
    if ctx.invoked_subcommand != "run":
        imports_done()


RULE = PrefillRule()  # the defaults of the prefill flags
Num = float | None  # a hardware figure of `plan`: None takes the --gpu preset's (or the H100 default)


def _opt(help: str):
    return typer.Option(help=help)


FREE_SHARE_HELP = (
    "Fetch the UND (text) halves for the whole world when this share of all slots is free with no "
    "prefilled request to take it (docs/scale.md: prefill passes)."
)
MAX_WAIT_HELP = "... or when a free slot has waited this many passes for a UND pass."
FP8_COMPUTE_HELP = (
    "FP8 checkpoints only. checkpoint: the checkpoint's step policy (W8A16 on its first/last steps, W8A8 "
    "between; W8A16 throughout where no FP8 GEMM exists, i.e. GPUs before Ada: torch's CPU kernel runs "
    "W8A8); a16: W8A16 (dequantize, then the linear) on every step."
)
MAX_BATCH_ROWS_HELP = (
    "With --batch-branches: at most this many rows (tokens x branches) per batched layer call (a longer "
    "branch runs alone): a bound on its transient device memory, which `plan` counts."
)
DTYPE_HELP = (
    "The transformer's compute dtype. checkpoint (default): the dtype it stores (bf16 for NVIDIA's "
    "releases); bfloat16 / float32: cast on load. Outputs equal diffusers' "
    "Cosmos3OmniPipeline.from_pretrained(path, dtype={'transformer': D, 'vae': V}) (docs/running.md)."
)
VAE_DTYPE_HELP = "The VAE's compute dtype, likewise (checkpoint, bfloat16 or float32)."
LOOKAHEAD_HELP = "Requests per rank prefilled ahead on a UND pass (their UND K/V kept until a slot frees)."
CHUNK_GAP_HELP = (
    "Transfer chains: passes a chain sits out at each chunk boundary while the finisher thread decodes the "
    "chunk and encodes the next one beside the other requests' passes (0: the loop waits for it at once). "
    "Raise it when the sidecars' boundary_wait_s is above 0 while other requests were active (alone, a "
    "chain's gap passes fetch nothing and a wait is the boundary itself; docs/transfer.md)."
)
SP_HELP = (
    "Sequence parallelism: groups of S consecutive ranks share each request, its GEN tokens split over "
    "them (Ulysses all-to-all over heads around attention). S must divide the ranks and the attention "
    "heads, and divide or be a multiple of the key/value heads. Lower latency per long clip; plain data "
    "parallelism (1, the default) gives more outputs per GPU-hour."
)
VAE_PP_HELP = "P ranks (P divides --sp) decode and encode each request together: ~1/P decode memory per rank."
PROMPTS_HELP = (
    "Request files: .jsonl (one object per line), .json (an array of objects, or one), .parquet or .csv "
    "(columns = request fields); several files or quoted globs ('prompts/*.json'); - reads JSONL from "
    "standard input. Fields: docs/requests.md."
)
MODEL_HELP = (
    "Diffusers-layout Cosmos3 checkpoint folder, or a Hugging Face repo id ORG/NAME or ORG/NAME@REVISION "
    "found in the local cache (downloaded unless HF_HUB_OFFLINE=1). Default: the built-in tiny model."
)
GUARDRAILS_HELP = (
    "NVIDIA's guardrails (cosmos-guardrail: blocklist + Qwen3Guard on each prompt before admission, face "
    "pixelation on the frames before encoding; docs/guardrails.md). Default: on for real checkpoints "
    "(their models must be in the local Hugging Face cache, else exit 2), off for make-tiny's models."
)
PLAN_GUARD_HELP = "As `run --guardrails`: their memory per rank and time per request (default as `run`)."
SAMPLES_HELP = 'Outputs per request that names no "samples": ids <id>-<k>, seeds seed + k (k = 0..N-1).'
PROMPT_COLUMN_HELP = "Table inputs: the column holding the prompt (e.g. caption)."
ID_COLUMN_HELP = "Table inputs: the column holding the id."
INPUT_FORMAT_HELP = (
    "auto (NVIDIA cosmos-framework sample files told apart by their keys, with a log line), cosmos3-batch "
    "(this tool's requests), cosmos-framework (NVIDIA's inference samples as they are: docs/requests.md)."
)
METRICS_TEXTFILE_HELP = (
    "Rank 0 keeps the job's live figures in this Prometheus text file (for the node exporter's textfile "
    "collector): requests by state, outputs/s, passes, bytes moved, stall, per-rank seconds since progress "
    "(docs/running.md). Rewritten atomically every --metrics-interval-s and at the end."
)
SKIP_INVALID_HELP = (
    "Run the valid requests and record the invalid ones instead of exiting with 2 (an input that is missing, "
    "unreadable or empty still exits 2)."
)
METRICS_INTERVAL_HELP = "Seconds between two writes of --metrics-textfile."


@app.command()
def run(
    prompts: Annotated[list[str], typer.Argument(help=PROMPTS_HELP)],
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    out: Annotated[Path, typer.Option(help="Output folder: <id>.png/.mp4, <id>.json, metrics.csv.")] = Path(
        "out"
    ),
    max_active: Annotated[
        int, typer.Option(help="Requests denoised together per process; they share every layer fetch.")
    ] = 4,
    save_latents: Annotated[bool, typer.Option(help="Also write <id>.latents.safetensors.")] = False,
    vae_tiling: Annotated[
        bool, typer.Option(help="Decode in tiles: less device memory, output no longer bit-exact.")
    ] = False,
    skip_invalid: Annotated[bool, typer.Option(help=SKIP_INVALID_HELP)] = False,
    overwrite: Annotated[
        bool,
        typer.Option(help="Regenerate requests whose outputs are already complete (default: skip them)."),
    ] = False,
    device: Annotated[str, _opt("auto (LOCAL_RANK's GPU), cpu, cuda, cuda:N (all ranks on GPU N).")] = "auto",
    offload: Annotated[
        str,
        typer.Option(
            help="allgather: each rank keeps 1/N of every layer in host RAM, gathered per layer (default); "
            "local: every rank streams whole layers from the node-shared checkpoint; resident: all "
            "weights on the device (baseline); sharded: 1/N of every layer on the device, gathered per layer."
        ),
    ] = "allgather",
    collective_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds a collective may wait for a peer before the job ends with 69 (a stalled or dead "
            "rank, named in one line: requeue the job); rank 0 warns at half of it."
        ),
    ] = 600.0,
    load_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds the ranks wait for each other to finish loading (a cold read of a 128 GB "
            "checkpoint from a network filesystem takes minutes), instead of --collective-timeout-s."
        ),
    ] = 3600.0,
    max_vision_tokens: Annotated[
        int,
        typer.Option(
            help="Reject requests above this many vision tokens (latent frames x (H/32) x (W/32)) before "
            "loading, so one request cannot exhaust a GPU. 1280x720x189 frames = 44,160."
        ),
    ] = 65536,
    und_cache: Annotated[
        bool,
        typer.Option(help="Cache each prompt's UND K/V once (default). --no-und-cache is an ablation only."),
    ] = True,
    und_resident: cli_reasoner.UndResident = None,
    max_reason_active: cli_reasoner.MaxReasonActive = None,
    shard: Annotated[
        str | None,
        typer.Option(
            help="INDEX/COUNT: run only this slice of PROMPTS (by id hash), e.g. a Slurm array task."
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    prefill_free_share: Annotated[float, typer.Option(help=FREE_SHARE_HELP)] = RULE.free_share,
    prefill_max_wait: Annotated[int, typer.Option(help=MAX_WAIT_HELP)] = RULE.max_wait,
    prefill_lookahead: Annotated[int, typer.Option(help=LOOKAHEAD_HELP)] = RULE.lookahead,
    chunk_gap_passes: Annotated[int, typer.Option(help=CHUNK_GAP_HELP)] = RULE.chunk_gap,
    batch_branches: Annotated[
        bool | None,
        typer.Option(
            "--batch-branches/--no-batch-branches",
            help="Apply each layer part to all of a rank's branches with their rows joined (default: on for "
            "GPUs; off on CPU, where only one branch at a time is bit-exact with the reference).",
        ),
    ] = None,
    max_batch_rows: Annotated[int, typer.Option(help=MAX_BATCH_ROWS_HELP)] = MAX_BATCH_ROWS,
    fp8_compute: Annotated[str, typer.Option(help=FP8_COMPUTE_HELP)] = "checkpoint",
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "checkpoint",
    vae_dtype: Annotated[str, typer.Option(help=VAE_DTYPE_HELP)] = "checkpoint",
    sp: Annotated[int, typer.Option("--sp", help=SP_HELP)] = 1,
    vae_patch_parallel_size: Annotated[int, typer.Option(help=VAE_PP_HELP)] = 1,
    samples_per_prompt: Annotated[int, typer.Option(help=SAMPLES_HELP)] = 1,
    prompt_column: Annotated[str | None, typer.Option(help=PROMPT_COLUMN_HELP)] = None,
    id_column: Annotated[str | None, typer.Option(help=ID_COLUMN_HELP)] = None,
    input_format: Annotated[str, typer.Option(help=INPUT_FORMAT_HELP)] = "auto",
    format: cli_data.Format = None,
    layout: cli_data.Layout = None,
    shard_size: cli_data.ShardSize = None,
    metrics_textfile: Annotated[Path | None, typer.Option(help=METRICS_TEXTFILE_HELP)] = None,
    metrics_interval_s: Annotated[float, typer.Option(help=METRICS_INTERVAL_HELP)] = 15.0,
    cache: cli_cache.Cache = "none",
    cache_threshold: cli_cache.Threshold = cli_cache.SEA.threshold,
    cache_residual_order: cli_cache.ResidualOrder = cli_cache.SEA.residual_order,
    cache_retention_steps: cli_cache.RetentionSteps = cli_cache.SEA.retention_steps,
    cache_end_steps: cli_cache.EndSteps = cli_cache.SEA.cache_end_steps,
    cache_max_consecutive: cli_cache.MaxConsecutive = cli_cache.SEA.max_consecutive_cached,
    cache_power_exp: cli_cache.PowerExp = cli_cache.SEA.power_exp,
    guardrails: Annotated[
        bool | None, typer.Option("--guardrails/--no-guardrails", help=GUARDRAILS_HELP)
    ] = None,
    upsample: cli_chain.Upsample = False,
    upsample_template: cli_chain.UpsampleTemplate = None,
    upsample_format: cli_chain.UpsampleFormat = "json",
    upsample_fallback: cli_chain.UpsampleFallback = "fail",
    upsample_max_new_tokens: cli_chain.UpsampleTokens = cli_chain.DEFAULTS[4],
    caption: cli_chain.Caption = False,
    caption_max_new_tokens: cli_chain.CaptionTokens = cli_chain.DEFAULTS[6],
) -> None:
    """Generate every request of PROMPTS. Exit 0: all ok; 1: some failed, or the checkpoint changed under
    the job; 2: bad input (nothing loaded); 69: a peer rank stalled past --collective-timeout-s or died
    (requeue the job); 75: the output filesystem is full or read-only (free space and rerun); 130 / 143:
    stopped by SIGINT (Ctrl-C) / SIGTERM after writing what was finished (rerun to resume). Every rank exits
    with the same code (a rank that stalled or died excepted)."""
    from cosmos3_batch.config import ConfigError, make_config
    from cosmos3_batch.parallel.exit_codes import ExitCode, after_rank_0
    from cosmos3_batch.pipeline.job.run import run_job

    _setup_logging()
    try:
        cfg = make_config(
            prompts=tuple(prompts),
            out=out,
            model=model,
            max_active=max_active,
            save_latents=save_latents,
            vae_tiling=vae_tiling,
            skip_invalid=skip_invalid,
            overwrite=overwrite,
            device=device,
            progress=progress,
            offload=offload,
            collective_timeout_s=collective_timeout_s,
            load_timeout_s=load_timeout_s,
            max_vision_tokens=max_vision_tokens,
            und_cache=und_cache,
            und_resident=und_resident,
            max_reason_active=max_reason_active,
            shard=shard,
            prefill=(prefill_free_share, prefill_max_wait, prefill_lookahead, chunk_gap_passes),
            batch_branches=batch_branches,
            max_batch_rows=max_batch_rows,
            fp8_compute=fp8_compute,
            dtype=dtype,
            vae_dtype=vae_dtype,
            sp=sp,
            vae_patch_parallel_size=vae_patch_parallel_size,
            samples_per_prompt=samples_per_prompt,
            prompt_column=prompt_column,
            id_column=id_column,
            input_format=input_format,
            format=format,
            layout=layout,
            shard_size=shard_size,
            metrics_textfile=metrics_textfile,
            metrics_interval_s=metrics_interval_s,
            cache=(cache, cache_threshold, cache_residual_order, cache_retention_steps, cache_end_steps,
                   cache_max_consecutive, cache_power_exp),
            guardrails=guardrails,
            chain=(upsample, upsample_template, upsample_format, upsample_fallback, upsample_max_new_tokens,
                   caption, caption_max_new_tokens),
        )  # fmt: skip
    except ConfigError as exc:  # the same flags on every rank: one of them says so, once
        typer.echo(f"error: {after_rank_0(str(exc))}", err=True)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    code, line, error = run_job(cfg)
    if line is not None:
        typer.echo(line)
    if error is not None:
        typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code)


@app.command()
def plan(
    prompts: Annotated[list[str], typer.Argument(help=PROMPTS_HELP)],
    nproc: Annotated[int, typer.Option(help="Ranks in the job (GPUs x nodes).")] = 1,
    model: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint folder or HF repo id (configs and headers only are read): memory, time."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes the ranks are spread over.")] = 1,
    offload: Annotated[str, typer.Option(help="Offload mode to size (as `run --offload`).")] = "allgather",
    und_resident: cli_reasoner.PlanUndResident = None,
    max_active: Annotated[int, typer.Option(help="Requests per rank sharing each layer (as `run`).")] = 4,
    max_reason_active: cli_reasoner.PlanMaxReasonActive = None,
    gpu: Annotated[
        str | None, _opt("Presets: h100, h200, b200, b300 (docs/scale.md); flags below win.")
    ] = None,
    h2d_gbps: Annotated[Num, _opt("Host->device GB/s per GPU (default: H100 PCIe Gen5, 50).")] = None,
    gather_gbps: Annotated[Num, _opt("AllGather bus GB/s in a node (default: NVLink 4, 350).")] = None,
    inter_node_gbps: Annotated[Num, _opt("Per-GPU GB/s across nodes (default: 400G IB, 45).")] = None,
    tflops: Annotated[Num, _opt("Achievable dense bf16 TFLOP/s per GPU (default: H100, 600).")] = None,
    hbm_gbps: Annotated[Num, _opt("Achievable HBM GB/s (default: H100, 2680).")] = None,
    device_gib: Annotated[Num, _opt("Device memory per GPU (default: H100, 80).")] = None,
    host_gib: Annotated[Num, _opt("Host memory per node (default 2000).")] = None,
    shard: Annotated[
        str | None, typer.Option(help="INDEX/COUNT: plan only this slice, as `run --shard`.")
    ] = None,
    max_vision_tokens: Annotated[int, typer.Option(help="As `run --max-vision-tokens`.")] = 65536,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    prefill_free_share: Annotated[
        float, typer.Option(help="As `run --prefill-free-share`.")
    ] = RULE.free_share,
    prefill_max_wait: Annotated[int, typer.Option(help="As `run --prefill-max-wait`.")] = RULE.max_wait,
    prefill_lookahead: Annotated[int, typer.Option(help="As `run --prefill-lookahead`.")] = RULE.lookahead,
    chunk_gap_passes: Annotated[int, typer.Option(help="As `run --chunk-gap-passes`.")] = RULE.chunk_gap,
    sp: Annotated[int, typer.Option("--sp", help="As `run --sp`: plan groups of S ranks per request.")] = 1,
    vae_patch_parallel_size: Annotated[int, _opt("As `run`: the decode's time and memory per rank.")] = 1,
    samples_per_prompt: Annotated[int, typer.Option(help="As `run --samples-per-prompt`.")] = 1,
    dtype: Annotated[
        str, typer.Option(help="As `run --dtype`: the bytes moved and held per rank.")
    ] = "checkpoint",
    vae_dtype: Annotated[str, typer.Option(help="As `run --vae-dtype`: the decode's bytes.")] = "checkpoint",
    max_batch_rows: Annotated[
        int, typer.Option(help="As `run --max-batch-rows`: the transient of one batched call.")
    ] = MAX_BATCH_ROWS,
    vae_tiling: Annotated[
        bool, typer.Option(help="As `run --vae-tiling`: the decode's peak, tiled.")
    ] = False,
    prompt_column: Annotated[str | None, typer.Option(help=PROMPT_COLUMN_HELP)] = None,
    id_column: Annotated[str | None, typer.Option(help=ID_COLUMN_HELP)] = None,
    input_format: Annotated[str, typer.Option(help=INPUT_FORMAT_HELP)] = "auto",
    cache: cli_cache.Cache = "none",
    cache_reuse: cli_cache.Reuse = cli_cache.PUBLISHED_REUSE,
    guardrails: Annotated[
        bool | None, typer.Option("--guardrails/--no-guardrails", help=PLAN_GUARD_HELP)
    ] = None,
    upsample: cli_chain.Upsample = False,
    upsample_max_new_tokens: cli_chain.UpsampleTokens = cli_chain.DEFAULTS[4],
    caption: cli_chain.Caption = False,
    caption_max_new_tokens: cli_chain.CaptionTokens = cli_chain.DEFAULTS[6],
) -> None:
    """Validate PROMPTS without loading weights; show the rank schedule and, with --model, memory and time."""
    import json

    from cosmos3_batch.plan import job_plan
    from cosmos3_batch.plan.hardware import Hardware, preset, with_overrides
    from cosmos3_batch.plan.prefill import PrefillRule
    from cosmos3_batch.requests.chain import chain_defaults
    from cosmos3_batch.requests.sources import STDIN, Columns

    stdin = sys.stdin.buffer.read() if STDIN in prompts else None
    try:
        hw = with_overrides(
            preset(gpu) if gpu is not None else Hardware(),
            h2d_gbps=h2d_gbps, gather_gbps=gather_gbps, inter_node_gbps=inter_node_gbps, tflops=tflops,
            hbm_gbps=hbm_gbps, device_gib=device_gib, host_gib_per_node=host_gib,
        )  # fmt: skip
        rule = PrefillRule(prefill_free_share, prefill_max_wait, prefill_lookahead, chunk_gap_passes)
        chain = chain_defaults(upsample, None, "json", "fail", upsample_max_new_tokens, caption,
                               caption_max_new_tokens)  # fmt: skip
        doc, text = job_plan.plan_job(
            prompts, model, nproc, nnodes, offload, max_active, hw, shard, max_vision_tokens, rule, sp,
            samples=samples_per_prompt, columns=Columns(prompt_column, id_column), stdin=stdin, dtype=dtype,
            vae_dtype=vae_dtype, max_batch_rows=max_batch_rows, vae_tiling=vae_tiling,
            vae_parts=vae_patch_parallel_size, cache=cli_cache.plan_cache(cache, cache_reuse),
            input_format=input_format, und_resident=und_resident, guardrails=guardrails, chain=chain,
            max_reason_active=max_reason_active,
        )  # fmt: skip
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(doc, indent=2) if json_out else text)


cli_models.register(app)  # make-tiny, convert
cli_data.register(app)  # report, status, manifest, export lerobot


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    for noisy in ("diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: see exit_codes.leave_now
            from cosmos3_batch.parallel.exit_codes import leave_now

            leave_now(exc.code if isinstance(exc.code, int) else 1)
        raise
