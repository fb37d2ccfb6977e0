"""Stalled ranks (DESIGN.md §20), for real: the chaos test's SIGSTOPs (tests/dist/test_stop.py has the other
stops; these live here because each costs a collective timeout). One output folder, two stalled jobs under
`cosmos3-torchrun`, then one rerun:

1. 2 gloo ranks, rank 1's worker stopped with SIGSTOP mid-job. Rank 0 warns at half the timeout, times
   out, names rank 1 and where the job was in one line, no traceback, and exits 69; the launcher ends with
   69 and names rank 1 too (not the SIGKILL it sent the stopped worker 30 s later). The default
   `--offload allgather`: the stop catches rank 0 in the per-pass exchange or in a layer part's gather
   ("at pass 23, the gather of layer 1's GEN part"), and the warning names the same place as the error.
2. 4 ranks in two `--sp 2` groups, rank 2 (the first rank of the second group) stopped: its partner waits
   in the group's collectives, ranks 0 and 1 in the world's; every survivor exits 69 and one line names
   rank 2.

After each: every survivor exited within the timeout plus a stated bound, and nothing is half-written under
a final name (every sidecar says complete; every final-named file reads whole). The rerun generates exactly
the rest, bit-exact with an uninterrupted run, nothing twice, and leaves no temporary of the stopped ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from cosmos3_batch.parallel.launch import AGENT_MARGIN_S
from cosmos3_batch.parallel.stall import BOUND_S
from tests.conftest import assert_same_outputs, write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON, run_here
from tests.dist.test_stop import alive, children, command, ok_rows

pytestmark = pytest.mark.dist
TIMEOUT_S = (
    10  # --collective-timeout-s: short, but above any start-up skew of four ranks on a busy 2-core box
)
# A survivor exits within its own timeout, the meeting after it (min(timeout, BOUND_S)) and this: reaching
# the collective the stopped rank misses (at most a pass) and leaving, on a shared CPU. Generous on purpose.
SLACK_S = 30
ROWS = [
    {"id": f"t{i}", "prompt": "a lighthouse", "num_frames": 1, "size": "32x32", "num_inference_steps": 20}
    for i in range(16)
]
IDS = [row["id"] for row in ROWS]


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in env if item.startswith(b"RANK="))[5:])


def done(out: Path) -> int:
    return sum(1 for rid in IDS if (out / f"{rid}.json").exists())


@dataclass
class Stalled:
    code: int  # the launcher's
    seconds: float  # from the SIGSTOP to the launcher's exit
    exits: dict[int, float]  # survivor rank -> seconds from the SIGSTOP to its worker's exit
    output: str  # the launcher's stdout and stderr, with every rank's


def stall_rank(
    cmd: list[str], out: Path, rank: int, after: int, log: Path, kill_after: bool = False
) -> Stalled:
    """Start the job, SIGSTOP rank `rank`'s worker once `after` outputs exist, and time each survivor's exit.
    `kill_after`: SIGKILL the stopped worker as torchrun's agent would, but once every survivor has left and
    the agent has seen them leave first (AGENT_MARGIN_S) rather than its 30 s later: the same verdict."""
    with open(log, "w") as sink:  # a file, not a pipe: four ranks' logs must not fill a pipe nobody reads
        proc = subprocess.Popen(cmd, env=ENV, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        while done(out) < after:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no output within 240 s"
            time.sleep(0.02)
        workers = {rank_of(pid): pid for pid in children(proc.pid)}
        os.kill(workers[rank], signal.SIGSTOP)
        sent = time.monotonic()
        try:
            exits = _watch_exits(proc, workers, rank, sent, kill_after)
        finally:
            if alive(workers[rank]):
                os.kill(workers[rank], signal.SIGKILL)
    return Stalled(proc.returncode, time.monotonic() - sent, exits, log.read_text())


def _watch_exits(
    proc, workers: dict[int, int], stopped: int, sent: float, kill_after: bool
) -> dict[int, float]:
    exits: dict[int, float] = {}
    limit = sent + TIMEOUT_S + 60 + 30 + 60  # timeout, meeting, the agent's wait, slack
    while proc.poll() is None:
        now = time.monotonic()
        assert now < limit, f"the launcher still runs {now - sent:.0f} s after the SIGSTOP"
        for r, pid in workers.items():
            if r != stopped and r not in exits and not alive(pid):
                exits[r] = now - sent
        if (
            kill_after
            and len(exits) == len(workers) - 1
            and now - sent > min(exits.values()) + AGENT_MARGIN_S + 2
        ):
            os.kill(workers[stopped], signal.SIGKILL)
            kill_after = False
        time.sleep(0.05)
    return exits


def check_survivors(stalled: Stalled, survivors: list[int], stopped: int) -> str:
    """Every survivor exited 69 in time, the job's one line names `stopped`, no traceback; that line."""
    output = stalled.output
    assert stalled.code == 69, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    assert sorted(stalled.exits) == survivors, (stalled.exits, output[-3000:])
    assert max(stalled.exits.values()) < TIMEOUT_S + min(TIMEOUT_S, BOUND_S) + SLACK_S, stalled.exits
    said = [line for line in output.splitlines() if "did not arrive" in line or "left the job" in line]
    assert len(said) == 1, output[-3000:]
    assert f"error: rank {stopped} did not arrive within --collective-timeout-s {TIMEOUT_S} at " in said[0]
    assert said[0].endswith("Requeue the job: a rerun generates exactly the rest (exit 69)"), said[0]
    last = output.strip().splitlines()[-1]  # every survivor's code is the launcher's list of 69s
    ranks = ", ".join(map(str, survivors))
    assert last.startswith(
        f"cosmos3-torchrun: the job exited with 69 (ranks {ranks}): rank(s) {stopped} stalled"
    )
    return said[0]


def assert_nothing_half_written(out: Path) -> int:
    """Every sidecar says complete and every final-named file reads whole; the stopped ranks' temporaries
    (hidden, `.NAME.PID.*.tmp.EXT`) are what may remain: their count."""
    for path in (p for p in out.iterdir() if p.is_file() and not p.name.startswith(".")):
        if path.suffix == ".json":
            assert json.loads(path.read_text())["status"] == "complete", path.name
        elif path.suffix == ".png":
            Image.open(path).load()
        else:
            assert path.name.endswith(".latents.safetensors"), path.name
            load_file(path)
    return sum(1 for p in out.glob(".*.tmp.*"))


def check_first(stalled: Stalled) -> tuple[str, str, str]:
    """The 2-rank stall through the agent's real SIGKILL: the warning, the error, the launcher's line."""
    said = check_survivors(stalled, [0], 1)
    place = r"pass \d+, (the per-pass exchange|the gather of layer \d+'s (GEN|UND) part)"
    where = re.search(f" at ({place}) ", said)
    assert where, said
    # Before the timeout, rank 0 said it had waited half of it, for rank 1, wherever the stop caught it: a
    # stall is visible before it ends.
    warned = [line for line in stalled.output.splitlines() if "rank 0 has waited" in line]
    assert len(warned) == 1, stalled.output[-3000:]
    assert f"for rank 1 at {where[1]} (at --collective-timeout-s 10 the job ends with 69)" in warned[0]
    assert stalled.output.index(warned[0]) < stalled.output.index(said)
    # The survivor left one timeout and one meeting after the stop; the launcher then waited 30 s for the
    # stopped worker to answer its SIGTERM. Generous bounds: the CPU is shared.
    assert stalled.seconds < TIMEOUT_S + TIMEOUT_S + 30 + 45, stalled.seconds
    return warned[0], said, stalled.output.strip().splitlines()[-1]


def test_stalled_ranks_end_the_job_with_69_in_one_line_and_the_rerun_does_exactly_the_rest(
    tmp_path, tiny_ckpt
):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_here(command(1, prompts, tiny_ckpt, ref)[3:]) == 0
    timeout = ["--collective-timeout-s", str(TIMEOUT_S)]
    first = stall_rank([*command(2, prompts, tiny_ckpt, out), *timeout], out, 1, 3, tmp_path / "first.log")
    lines = check_first(first)
    after_first = done(out)
    assert 3 <= after_first < len(IDS)
    left = assert_nothing_half_written(out)

    sp = [*command(4, prompts, tiny_ckpt, out, sp=2), *timeout]
    second = stall_rank(sp, out, 2, after_first + 2, tmp_path / "second.log", kill_after=True)
    said = check_survivors(second, [0, 1, 3], 2)
    before = done(out)
    assert after_first + 2 <= before < len(IDS)
    left += assert_nothing_half_written(out)

    rerun = subprocess.run(command(2, prompts, tiny_ckpt, out), env=ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["generated_ok"], summary["skipped_complete"]) == (len(IDS) - before, before)
    assert_same_outputs(ref, out, IDS)
    assert ok_rows(out) == Counter(IDS)  # nothing generated twice over three runs
    assert not [p for p in out.rglob("*") if ".tmp" in p.name], "temporaries left behind"
    for name, stalled in (("rank 1 of 2", first), ("rank 2 of 4, --sp 2", second)):
        times = ", ".join(f"rank {r} {s:.1f} s" for r, s in sorted(stalled.exits.items()))
        print(f"SIGSTOP of {name} -> survivors' exit 69: {times}; launcher {stalled.seconds:.1f} s")
    print(f"{after_first} then {before} outputs before the rerun; {left} temporaries left by the stops")
    print("\n".join([*lines, said]))


def test_a_local_error_that_speaks_of_a_timeout_exits_1_not_69(tmp_path, tiny_ckpt):
    """Issue 43: a rank's own RuntimeError whose text says "timed out" and "Connection closed by peer" is
    its own crash (exit 1, its traceback), not a peer's stall: only a collective call's failure is a peer's.
    Rank 0, whose load barrier then loses rank 1, is the one that sees a peer go."""
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:2])
    launch = [JOB_PYTHON, "-m", "cosmos3_batch.parallel.launch", "--standalone", "--nproc-per-node=2"]
    args = ["run", str(prompts), "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--no-progress"]
    done = subprocess.run(
        [*launch, "-m", "tests.dist.local_error_worker", *args, "--collective-timeout-s", str(TIMEOUT_S)],
        env=ENV, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "reading /ckpt/transformer timed out" in done.stderr
    assert "stalled" not in done.stderr.splitlines()[-1]
