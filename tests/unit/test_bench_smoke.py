"""The benchmark runs end to end in its small configuration (no timing is asserted), and gpu_check's
CPU-independent parts hold: token arithmetic, layer sizes, budget, and the engine wiring on CPU."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# One row of each way the bench launches (the CLI under torchrun with its flags, the peer driver under
# torchrun and in one process) and the baseline the ratios divide by. The modes' other rows launch the same
# way; their outputs are checked bit for bit in tests/dist/test_runs.py.
CONFIGS = [
    "resident",
    "allgather-K1-nocache",
    "fsdp2-cpu-offload",
    "diffusers-group-offload",
    "peer-driver-control",
]
OURS = ["resident", "allgather-K1-nocache"]
NO_CUDA = not torch.cuda.is_available()


def _script(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module while the class is built
    spec.loader.exec_module(module)
    return module


gpu_layers = _script("layers", "gpu/layers.py")  # registered as `layers`, which its siblings import
gpu_check = _script("gpu_check", "gpu/check.py")
gpu_check_engine = _script("gpu_check_engine", "gpu/check_engine.py")


@pytest.mark.dist
def test_bench_quick_writes_one_row_per_configuration(tmp_path):
    out = tmp_path / "bench.csv"
    script = str(ROOT / "scripts" / "bench" / "offload_modes.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        # One rank: the smoke run checks the launch paths and the table, not scaling (tests/dist/test_runs.py
        # holds the modes at 2-4 ranks); half the processes on a 2-core CI machine.
        [sys.executable, script, "--quick", "--world", "1", "--csv", str(out), "--only", *CONFIGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        rows = {row["config"]: row for row in reader}
        header = reader.fieldnames
    for column in ("s_per_output", "time_vs_resident", "weight_MB_per_output", "peak_rss_MB"):
        assert column in header
    for column in ("peak_private_MB", "peak_device_MB", "same_as_resident", "note"):
        assert column in header
    assert list(rows) == CONFIGS
    for name in OURS:
        row = rows[name]
        assert int(row["outputs"]) == 4, row
        assert float(row["s_per_output"]) > 0
        assert float(row["peak_rss_MB"]) > 0 and float(row["peak_private_MB"]) > 0
        assert row["same_as_resident"] == "yes", row  # every mode reproduces resident bit for bit
        moved = float(row["weight_MB_per_output"])
        assert moved == 0 if name.startswith("resident") else moved > 0
    for name in set(CONFIGS) - set(OURS):  # a peer has numbers, or the row says why it has none
        row = rows[name]
        assert row["s_per_output"] or row["note"].startswith(("n/a", "failed")), row
    if NO_CUDA:
        assert {row["peak_device_MB"] for row in rows.values() if row["outputs"]} == {"n/a (no CUDA)"}
    assert "| config |" in proc.stdout  # the markdown table


# ---- gpu_check: the parts that need no GPU --------------------------------------------------------------


def test_vision_tokens_match_the_scheduler(tmp_path):
    from cosmos3_batch.plan.schedule import vision_tokens
    from cosmos3_batch.requests.parse import load_requests

    sizes = [(832, 480, 29), (1280, 720, 29), (1280, 720, 189), (1024, 1024, 1), (64, 48, 9)]
    rows = [
        {"id": f"r{i}", "prompt": "x", "size": f"{w}x{h}", "num_frames": f}
        for i, (w, h, f) in enumerate(sizes)
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    requests, _ = load_requests(str(path))
    assert [gpu_layers.vision_tokens(w, h, f) for w, h, f in sizes] == [vision_tokens(r) for r in requests]
    # 480p: 8 latent frames x 15 x 26; 720p: x 23 (720/32 rounds up) x 40; 189 frames: 48 latent frames.
    assert [gpu_layers.vision_tokens(v.width, v.height, v.frames) for v in gpu_layers.VIDEOS] == [
        3120,
        7360,
        44160,
    ]


def test_nano_layer_parts_are_equal_halves():
    nano = gpu_layers.NANO
    linear = 2 * nano.hidden * nano.hidden + 2 * nano.hidden * 1024 + 3 * nano.hidden * nano.intermediate
    norms = 2 * nano.hidden + 2 * nano.head_dim
    assert gpu_layers.part_bytes() == {"und": 2 * (linear + norms), "gen": 2 * (linear + norms)}  # bf16


def test_gen_flops_count_matmuls_and_attention():
    nano, tokens, und = gpu_layers.NANO, 3120, 256
    linear = 2 * nano.hidden * nano.hidden + 2 * nano.hidden * 1024 + 3 * nano.hidden * nano.intermediate
    assert gpu_layers.gen_flops(tokens, 0) == 2 * tokens * linear + 4 * tokens * tokens * 4096
    assert gpu_layers.gen_flops(tokens, und) - gpu_layers.gen_flops(tokens, 0) == 4 * tokens * und * 4096


def test_fetch_and_overlap_arithmetic():
    assert gpu_check.fetch_ms(50 * 10**9, 50.0) == pytest.approx(1000.0)
    assert gpu_check.branches_to_hide(fetch=7.7, compute_per_branch=2.0) == 4
    assert gpu_check.branches_to_hide(fetch=1.0, compute_per_branch=5.0) == 1


def test_budget_uses_its_clock():
    now = [100.0]
    budget = gpu_layers.Budget(60, clock=lambda: now[0])
    assert budget.allows(59) and not budget.allows(61)
    now[0] += 30
    assert budget.left() == 30 and not budget.allows(31)


def test_arguments():
    args = gpu_check.parse_args([])
    assert (args.layers, args.budget_s, args.und_len, args.out) == (8, 450.0, 256, None)
    assert gpu_check.parse_args(["--layers", "4", "--out", "t.md"]).out == Path("t.md")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--layers", "1"])


def test_markdown_table():
    text = gpu_layers.markdown(["a", "b"], [["x", 1.23456], [2, "y"]])
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| x | 1.23 |", "| 2 | y |"]


def test_engine_check_wiring_on_cpu(tmp_path):
    """The engine section's path (checkpoint -> build_weights -> GEN passes) on CPU with tiny layers: every
    mode computes the very same GEN stream as the resident layers."""
    torch.manual_seed(0)
    shape = gpu_layers.LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    cpu, count = torch.device("cpu"), 3
    with torch.no_grad():
        layers = torch.nn.ModuleList(gpu_layers.random_layer(cpu, shape) for _ in range(count))
        gpu_check_engine.write_checkpoint(tmp_path / "transformer", layers)
        branches = [gpu_layers.branch(24, 8, count, cpu, shape) for _ in range(2)]
        results = {}
        for mode in ("resident", "local", "allgather"):
            weights = gpu_check_engine.engine_weights(mode, layers, tmp_path, count, cpu, shape)
            try:
                gpu_check_engine.pass_seconds(weights, gpu_layers.split_for(count), branches, count, 1, cpu)
            finally:
                weights.close()
            results[mode] = [seq.gen_hidden.clone() for seq, _ in branches]
    for mode in ("local", "allgather"):
        assert all(torch.equal(a, b) for a, b in zip(results["resident"], results[mode], strict=True))


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU message")
def test_gpu_check_says_it_needs_a_gpu(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    shell = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert shell.returncode == 2 and "no CUDA device" in shell.stderr


def test_gpu_check_shell_syntax():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
