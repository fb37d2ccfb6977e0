"""Exit codes through `cosmos3-torchrun` (real torchrun, 2 gloo ranks): bad input is 2 and one error line,
a run with a failed request is 1 on every rank; neither leaves a torchelastic error file or a traceback,
and the launcher ends with one line instead of torchrun's ChildFailedError block."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON

pytestmark = pytest.mark.dist


def launch(tmp_path: Path, prompts: Path, model: Path, out: Path) -> tuple[int, str, Path]:
    logs = tmp_path / "logs"
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch.parallel.launch", "--standalone", "--nproc-per-node=2"]
    cmd += ["--log-dir", str(logs), "-m", "cosmos3_batch", "run", str(prompts), "--model", str(model)]
    proc = subprocess.run([*cmd, "--out", str(out), "--no-progress"], env=ENV, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, logs


def assert_no_traceback_and_no_error_file(output: str, logs: Path) -> None:
    for text in ("Traceback", "ChildFailedError", "FAILED", "Root Cause"):
        assert text not in output, output[-3000:]
    assert not list(logs.rglob("error.json")), list(logs.rglob("error.json"))


def test_bad_input_under_the_launcher_is_exit_2_and_one_error_line(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x", "size": "33x32"}])
    code, output, logs = launch(tmp_path, prompts, tiny_ckpt, tmp_path / "out")
    assert code == 2, output[-3000:]
    assert output.count("error: ") == 1 and "line 1, field 'size'" in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last == "cosmos3-torchrun: the job exited with 2 (ranks 0, 1): " + (
        "bad input or configuration, nothing was generated"
    ), last
    assert_no_traceback_and_no_error_file(output, logs)


def test_a_failed_request_under_the_launcher_is_exit_1_on_every_rank(tmp_path, tiny_ckpt):
    rows = [
        {"id": f"r{i}", "prompt": "x", "size": "32x32", "num_frames": 1, "num_inference_steps": 2}
        for i in range(4)
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    (out / "r1.png").mkdir(parents=True)  # the write of r1 fails: a directory is in the way
    code, output, logs = launch(tmp_path, prompts, tiny_ckpt, out)
    assert code == 1, output[-3000:]
    # Both ranks exited 1 themselves: none was killed by the agent while tearing down.
    assert (
        output.strip().splitlines()[-1].startswith("cosmos3-torchrun: the job exited with 1 (ranks 0, 1): ")
    )
    assert_no_traceback_and_no_error_file(output, logs)
    summary = json.loads((out / "summary.json").read_text())
    assert [f["id"] for f in summary["failed"]] == ["r1"] and summary["generated_ok"] == 3


def test_a_slow_load_on_one_rank_waits_for_load_timeout_not_the_collective_timeout(tmp_path, tiny_ckpt):
    """Rank 1 takes 8 s longer to load than rank 0 and the collective timeout is 3 s: the ranks meet in the
    load barrier (--load-timeout-s 120), so the first collectives after loading do not time out."""
    rows = [{"id": "a", "prompt": "x", "size": "32x32", "num_frames": 1, "num_inference_steps": 1}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["run", prompts, "--model", tiny_ckpt, "--out", tmp_path / "out", "--no-progress"]
    args += ["--collective-timeout-s", "3", "--load-timeout-s", "120"]
    folder = tmp_path / "launch"
    folder.mkdir()
    (folder / "jobs.json").write_text(json.dumps([[str(a) for a in args]]))
    cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tests.dist.slow_load_worker", "8", str(folder / "jobs.json"), str(folder / "codes.json")]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((folder / "codes.json").read_text()) == [0]


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "cosmos3_batch.parallel.launch"])
def test_a_configuration_error_is_said_once_under_either_launcher(tmp_path, launcher):
    """`--model` names a folder without model_index.json: every rank finds it before the ranks meet. Rank 0
    starts 3 s late here: rank 1 used to exit at once, and the agent SIGTERMed rank 0 (the one that says it)
    before it printed. Now rank 1 waits for rank 0 to say it, once, and the job ends with 2."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    cmd = [JOB_PYTHON, "-m", launcher, "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tests.dist.slow_rank_zero", "3", "run"]
    cmd += [str(prompts), "--model", str(empty), "--out", str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    message = (
        f"error: --model {empty}: not a diffusers checkpoint folder "
        "(no model_index.json nor modular_model_index.json)"
    )
    assert output.count("not a diffusers checkpoint folder") == 1, output[-3000:]
    assert message in output, output[-3000:]
    if launcher == "cosmos3_batch.parallel.launch":
        assert proc.returncode == 2, output[-3000:]
        assert output.strip().splitlines()[-1].startswith("cosmos3-torchrun: the job exited with 2 (ranks 0")
    else:  # torchrun's own code and banner, after our line
        assert proc.returncode == 1 and output.index(message) < output.index("ChildFailedError"), output
