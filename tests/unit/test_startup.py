"""The collector paused at a job process's entry and its imports frozen (cosmos3_batch/startup.py), in a
real `python -m cosmos3_batch run` process; a program that calls the CLI in process keeps its collector."""

from __future__ import annotations

import gc
import json
import subprocess

from typer.testing import CliRunner

from cosmos3_batch.cli import app
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON

# Runs the real entry, with a probe where the job would start: what the collector looks like then.
PROBE = """
import gc, json, sys
import cosmos3_batch.pipeline.job.run as run
def probe(cfg, *args, **kwargs):
    print(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
    return 0
run.run_job = probe
sys.argv = ["cosmos3_batch", *sys.argv[1:]]
from cosmos3_batch.__main__ import main
main()
"""


def test_a_job_process_collects_again_after_its_imports_with_them_frozen(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    cmd = [JOB_PYTHON, "-c", PROBE, "run", str(prompts), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["enabled"] is True
    # torch, diffusers and transformers: about 330,000 objects here; the CLI alone imports about 20,000.
    assert seen["frozen"] > 100_000, seen


def test_a_program_calling_the_cli_keeps_its_collector(tmp_path):
    frozen = gc.get_freeze_count()
    result = CliRunner().invoke(app, ["run", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_every_other_command_collects_again_from_its_start():
    import cosmos3_batch.startup as startup

    startup.pause_collection()
    try:
        assert not gc.isenabled()
        result = CliRunner().invoke(app, ["plan", "--help"])
        assert result.exit_code == 0
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.enable()
        gc.unfreeze()
