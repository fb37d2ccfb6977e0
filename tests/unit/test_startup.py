"""The collector paused at a job process's entry and its imports frozen (cosmos3_batch/startup.py), in a
real `python -m cosmos3_batch run` process; a program that calls the CLI in process keeps its collector."""

from __future__ import annotations

import gc
import json
import subprocess

from typer.testing import CliRunner

import cosmos3_batch.startup as startup
from cosmos3_batch.cli import app
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON

# The real entry, with a probe on the moment the job resumes its collector (just before its load): what
# the collector did until then and what it holds after. It ends the process there.
PROBE = """
import gc, json, os, sys
import cosmos3_batch.startup as startup
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
resume = startup.imports_done
def probe():
    paused = not gc.isenabled()
    resume()
    seen = {"paused": paused, "full_collections": len(full), "enabled": gc.isenabled()}
    seen |= {"frozen": gc.get_freeze_count(), "vae_class": "diffusers.models.autoencoders" in sys.modules}
    print(json.dumps(seen), flush=True)
    os._exit(0)
startup.imports_done = probe
sys.argv = ["cosmos3_batch", *sys.argv[1:]]
from cosmos3_batch.__main__ import main
main()
"""


def test_a_job_process_imports_with_the_collector_paused_then_freezes_what_it_imported(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x", "size": "32x32"}])
    cmd = [JOB_PYTHON, "-c", PROBE, "run", str(prompts), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["paused"] and seen["full_collections"] == 0, seen  # no full collection during the imports
    assert seen["vae_class"], seen  # the load's classes among them
    assert seen["enabled"], seen
    # torch, diffusers and transformers: about 330,000 objects here; the CLI alone imports about 20,000.
    assert seen["frozen"] > 100_000, seen


def test_a_program_calling_the_cli_keeps_its_collector(tmp_path):
    frozen = gc.get_freeze_count()
    result = CliRunner().invoke(app, ["run", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    # Nothing more frozen (frozen objects that die leave the count: it can only shrink).
    assert gc.isenabled() and gc.get_freeze_count() <= frozen


def test_every_other_command_collects_again_from_its_start():
    frozen = gc.get_freeze_count()
    startup.pause_collection()
    try:
        assert not gc.isenabled()
        result = CliRunner().invoke(app, ["plan", "--help"])
        assert result.exit_code == 0
        assert gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.enable()
        startup._paused = False
