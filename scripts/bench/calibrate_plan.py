"""`plan`'s roofline against published Cosmos3-Nano times, side by side (docs/scale.md, "Calibration").

    python scripts/bench/calibrate_plan.py

Builds a config-only Nano folder (plan/shapes.py: Nano's transformer, the Wan2.2 VAE, the built-in tiny
model's tokenizer, no weights), plans each published configuration with its `--gpu` preset, and prints one
row per configuration: what was published, what the roofline says for the denoising steps, and their ratio
(plan / published; below 1 the roofline is optimistic). The roofline has no VAE decode, text encoding,
launch or Python time, and counts attention at the preset's FLOP rate: read the ratios with that in mind.
Nothing here is measured on this machine; it takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from cosmos3_batch.model.tiny import ensure_default_tiny
from cosmos3_batch.plan.hardware import preset
from cosmos3_batch.plan.job_plan import plan_job
from cosmos3_batch.plan.shapes import NANO_TRANSFORMER, WAN22_VAE

STEPS = 35
# (configuration, GPU, ranks, --offload, --sp, width, height, frames, published seconds, what they measure)
PUBLISHED = [
    ("Nano 1xB300, 25 frames", "b300", 1, "resident", 1, 1280, 720, 25, 7.0, "vLLM-Omni recipe, end to end"),
    ("Nano 1xB300, 49 frames", "b300", 1, "resident", 1, 1280, 720, 49, 15.0, "vLLM-Omni recipe, end to end"),
    ("Nano 1xB300, 93 frames", "b300", 1, "resident", 1, 1280, 720, 93, 33.0, "vLLM-Omni recipe, end to end"),
    (
        "Nano 1xB300, 189 frames",
        "b300",
        1,
        "resident",
        1,
        1280,
        720,
        189,
        93.0,
        "vLLM-Omni recipe, end to end",
    ),
    ("Nano 4xH200 (Ulysses 4), 189 frames", "h200", 4, "resident", 4, 1280, 720, 189, 57.8, "SGLang #27037"),
    ("Nano DP4 H200, DLO, 832x480x29", "h200", 4, "allgather", 1, 832, 480, 29, 1.020 * STEPS, "DLO blog"),
    ("Nano DP4 H200, HSDP, 832x480x29", "h200", 4, "sharded", 1, 832, 480, 29, 0.870 * STEPS, "DLO blog"),
    # vLLM-Omni's DLO streams every layer whole to every GPU over PCIe: what our `local` mode moves.
    (
        "  the same as whole-layer streaming (local)",
        "h200",
        4,
        "local",
        1,
        832,
        480,
        29,
        1.020 * STEPS,
        "DLO blog",
    ),
]


def nano_folder(root: Path) -> Path:
    folder = root / "nano"
    shutil.copytree(ensure_default_tiny(), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "transformer" / "config.json").write_text(json.dumps(NANO_TRANSFORMER))
    (folder / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
    return folder


def planned_seconds(model: Path, root: Path, row) -> tuple[float, float]:
    """(seconds for the denoising steps of one request per rank group, seconds per step)."""
    _, gpu, ranks, offload, sp, width, height, frames, _, _ = row
    request = {"prompt": "a robot arm", "size": f"{width}x{height}", "num_frames": frames}
    request["num_inference_steps"] = STEPS
    prompts = root / "p.jsonl"
    groups = ranks // sp  # one request per group, as the published runs did (DP4: one per GPU)
    prompts.write_text("".join(json.dumps({**request, "id": f"r{i}"}) + "\n" for i in range(groups)))
    doc, _ = plan_job(str(prompts), str(model), ranks, 1, offload, 1, preset(gpu), sp=sp)
    per_step = doc["estimate"]["seconds_per_pass"]
    return per_step * STEPS, per_step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = nano_folder(root)
        print("| configuration | published | plan (steps only) | plan / published | source |")
        print("| --- | --- | --- | --- | --- |")
        for row in PUBLISHED:
            name, *_, published, source = row
            total, per_step = planned_seconds(model, root, row)
            print(
                f"| {name} | {published:.1f} s | {total:.1f} s ({per_step * 1e3:.0f} ms/step) | "
                f"{total / published:.2f} | {source} |"
            )


if __name__ == "__main__":
    main()
