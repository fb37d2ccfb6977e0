"""jobs/*.sbatch under a REAL Slurm (the `cluster` fixture of conftest.py: slurmctld and two slurmd on this
machine). Every job must end COMPLETED, generate each request exactly once and reproduce a single-process
run bit for bit; a requeued job appends to its log and skips what is complete.

Skipped only where the packages cannot be installed (apt-get fails: no network, not root)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from cosmos3_batch.plan.schedule import in_shard
from tests.conftest import assert_same_outputs, write_jsonl
from tests.dist.jobs import JOB_PYTHON, run_here
from tests.slurm.conftest import FINAL_STATES, JOB_DEADLINE_S, Cluster, Job, binary, free_port, job_logs, poll

pytestmark = pytest.mark.slurm


def _row(rid: str, prompt: str, frames: int, steps: int, seed: int, **extra: float) -> dict:
    size = "32x32" if frames == 1 else "32x48"
    row = {"id": rid, "prompt": prompt, "num_frames": frames, "size": size, "num_inference_steps": steps}
    return {**row, "seed": seed, **extra}


# Images and videos with different steps, guidance and seeds share the passes of one job. The ids are
# chosen so that each of 3 shards gets at least one request (shard = hash of the id).
ROWS = [
    _row("img0", "a cat on a sofa", 1, 2, 100),
    _row("img1", "a red bicycle", 1, 3, 101, guidance_scale=1.0),  # no CFG: one branch
    _row("img2", "snow on mountains", 1, 1, 102),
    _row("vid0", "ocean waves at night", 5, 2, 103),
    _row("vid1", "a busy street", 5, 1, 104, guidance_scale=4.0, flow_shift=2.0),
    _row("vid2", "leaves in the wind", 5, 3, 105),
]
IDS = [row["id"] for row in ROWS]
# Long enough (one request at a time, 40 steps each) that the requeue most likely lands while the job runs;
# the checks hold wherever it lands (a requeued COMPLETED job reruns and skips everything).
REQUEUE_ROWS = [_row(f"rq{i}", "a lighthouse in fog", 1, 40, 200 + i, guidance_scale=1.0) for i in range(6)]
# A full disk: about five of these fit in the room left on the job's tmpfs.
FULL_ROWS = [_row(f"fd{i}", "a desert road", 1, 10, 300 + i, guidance_scale=1.0) for i in range(10)]
FULL_ROOM = 40 << 10
HELD = {"job_requeued_in_held_state", "JobHeldUser", "JobHeldAdmin"}  # what `scontrol requeuehold` leaves


# ---------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    root: Path
    prompts: Path
    model: Path


def _cosmos(*args: str | Path) -> None:
    # torchrun gives each worker one thread; the reference must use the same (CPU GEMMs reduce in a
    # thread-count-dependent order).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch", *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    root = tmp_path_factory.mktemp("slurm-jobs")
    prompts = write_jsonl(root / "prompts.jsonl", ROWS)
    # One checkpoint built before any job: jobs must not race to build the default one.
    model = root / "tiny"
    _cosmos("make-tiny", model)
    return Workload(root, prompts, model)


@pytest.fixture(scope="module")
def jobs(cluster: Cluster, workload: Workload) -> dict[str, Job]:
    """Submits all three jobs at once; Slurm schedules them onto the two nodes while the tests wait."""
    common = {
        **cluster.env,
        "PROMPTS": str(workload.prompts),
        "MODEL": str(workload.model),
        "EXTRA_ARGS": "--device cpu --save-latents --no-progress",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "COSMOS3_BATCH_CACHE": str(workload.root / "cache"),  # only used if MODEL were ignored
    }
    venv = Path(JOB_PYTHON).parents[1]  # the jobs' virtualenv (tests/dist/jobs.py), activated by the script
    if (venv / "bin" / "activate").exists():
        common["VENV"] = str(venv)
    else:
        common["PYTHON"] = JOB_PYTHON
    root = workload.root
    submitted = {}
    # First, and its test runs first: the requeue should land while this job runs.
    prompts = write_jsonl(root / "requeue.jsonl", REQUEUE_ROWS)
    env = {**common, "PROMPTS": str(prompts), "OUT": str(root / "requeue"), "MAX_ACTIVE": "1"}
    submitted["requeue"] = cluster.sbatch("single_node.sbatch", env=env, out=root / "requeue")
    # -c2: the script must hand --cpus-per-task on to srun (22.05 no longer inherits it).
    env = {
        **common,
        "OUT": str(root / "single"),
        "GPUS_PER_NODE": "2",
        "OFFLOAD": "allgather",
        "MAX_ACTIVE": "2",
    }
    submitted["single"] = cluster.sbatch("single_node.sbatch", "-c2", env=env, out=root / "single")
    env = {**common, "OUT": str(root / "multi"), "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port())}
    submitted["multi"] = cluster.sbatch("multi_node.sbatch", "-N2", env=env, out=root / "multi")
    # OUT on a small tmpfs, nearly full: the job exits 75 mid-run and the script requeues it held.
    disk = root / "fulldisk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mount.returncode == 0:
        st = os.statvfs(disk)
        (disk / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - FULL_ROOM))
        env = {**common, "PROMPTS": str(write_jsonl(root / "full.jsonl", FULL_ROWS)), "OUT": str(disk)}
        submitted["full"] = cluster.sbatch("single_node.sbatch", env=env | {"MAX_ACTIVE": "1"}, out=disk)
    # GPUS_PER_NODE unset: the script's default (1 rank per task without GPUs).
    env = {**common, "OUT": str(root / "array"), "OFFLOAD": "local"}
    submitted["array"] = cluster.sbatch(
        "dataset_array.sbatch", "--array=0-2", env=env, out=root / "array", tasks=3
    )
    return submitted


@pytest.fixture(scope="module")
def reference(workload: Workload, jobs: dict[str, Job]) -> Path:
    """The single-process run to compare with; it runs while the Slurm jobs do."""
    ref = workload.root / "ref"
    args = ["run", workload.prompts, "--model", workload.model, "--out", ref, "--offload", "resident"]
    assert run_here([*args, "--save-latents", "--device", "cpu", "--no-progress"]) == 0
    return ref


# ---------------------------------------------------------------------------------------------- checks


def finished(cluster: Cluster, job: Job) -> list[dict[str, str]]:
    tasks = cluster.wait(job)
    print(job_logs(job))  # pytest shows it only if the test fails
    bad = [
        (t.get("ArrayTaskId"), t["JobState"], t.get("ExitCode"))
        for t in tasks
        if t["JobState"] != "COMPLETED"
    ]
    if bad:
        pytest.fail(f"job {job.id}: {bad}{job_logs(job)}{cluster.daemon_logs()}")
    assert all(t.get("ExitCode") == "0:0" for t in tasks), [t.get("ExitCode") for t in tasks]
    return tasks


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_done_once(out: Path, ids: list[str], part_files: int) -> None:
    """Each request has a complete sidecar, one merged metrics row and one `ok` row across the part files."""
    for rid in ids:
        assert json.loads((out / f"{rid}.json").read_text())["status"] == "complete", rid
    merged = read_rows(out / "metrics.csv")
    assert sorted(row["id"] for row in merged) == sorted(ids)
    assert {row["status"] for row in merged} == {"ok"}
    parts = sorted((out / ".cosmos3_batch").glob("metrics.*.csv"))
    assert len(parts) == part_files, parts
    rows = [row for part in parts for row in read_rows(part)]
    # A requeue stops the first attempt with SIGTERM: what it had mid-denoise is on record as interrupted.
    assert {row["status"] for row in rows} <= {"ok", "interrupted"}, rows
    assert Counter(row["id"] for row in rows if row["status"] == "ok") == Counter(ids), rows


def test_requeue_appends_the_log_and_resumes(cluster: Cluster, jobs: dict[str, Job]) -> None:
    job = jobs["requeue"]
    ids = [row["id"] for row in REQUEUE_ROWS]
    # Requeue once the first request is complete (its sidecar is written last): the rerun must skip it.
    poll(
        lambda: (
            any((job.out / f"{rid}.json").exists() for rid in ids)
            or cluster.records(job.id)[0]["JobState"] in FINAL_STATES
        ),
        JOB_DEADLINE_S,
        lambda: f"job {job.id} wrote no request{job_logs(job)}",
    )
    # Refused only in the instant the job is COMPLETING: try again.
    poll(
        lambda: cluster.run(binary("scontrol"), "requeue", job.id).returncode == 0,
        30.0,
        lambda: f"scontrol requeue {job.id} keeps failing{job_logs(job)}",
    )
    # A requeued job waits (BeginTime) before it may start again; once it is back in the queue, lift that.
    poll(
        lambda: cluster.records(job.id)[0]["JobState"] != "COMPLETING",
        60.0,
        lambda: f"job {job.id} stuck COMPLETING{job_logs(job)}",
    )
    past_revocation()
    cluster.run(binary("scontrol"), "update", f"JobId={job.id}", "StartTime=now")
    (task,) = finished(cluster, job)
    assert task["Restarts"] == "1" and task["Requeue"] == "1", task  # Requeue=1: from #SBATCH --requeue
    log = (job.workdir / f"cosmos3-batch-{job.id}.out").read_text()
    assert "restart 0 on" in log and "restart 1 on" in log  # --open-mode=append kept the first attempt
    summary = json.loads((job.out / "summary.json").read_text())  # the second attempt's
    assert summary["failed"] == [] and summary["skipped_complete"] >= 1
    assert summary["generated_ok"] + summary["skipped_complete"] == len(ids)
    assert_done_once(job.out, ids, part_files=1)  # no request generated twice across the two attempts


def past_revocation() -> None:
    """Let the second in which Slurm killed the job's last attempt pass before it may start again.

    A requeue revokes the job's launch credentials on the node, at one-second resolution: slurmd refuses
    ("Job N already killed, do not launch batch job") a relaunch whose credential was made within that
    same second, and the job ends FAILED. A user releases a held job minutes later; a test must wait.
    """
    time.sleep(1.5)


def test_a_full_disk_holds_the_job_until_space_is_freed(cluster: Cluster, jobs: dict[str, Job]) -> None:
    if "full" not in jobs:
        pytest.skip("cannot mount a tmpfs here (not root)")
    job = jobs["full"]
    ids = [row["id"] for row in FULL_ROWS]
    try:
        # Exit 75: the script puts the job back in the queue, held, instead of letting it end.
        poll(
            lambda: cluster.records(job.id)[0].get("Reason") in HELD,
            JOB_DEADLINE_S,
            lambda: f"job {job.id} not held: {cluster.records(job.id)[0]}{job_logs(job)}",
        )
        log = (job.workdir / f"cosmos3-batch-{job.id}.out").read_text()
        assert "error: ENOSPC (No space left on device) writing " in log
        assert f"exit 75: the output filesystem is full or read-only. Holding job {job.id}" in log
        done = [rid for rid in ids if (job.out / f"{rid}.json").exists()]
        assert 0 < len(done) < len(ids), done
        (job.out / "ballast").unlink()  # free space, release: it resumes where it stopped
        past_revocation()
        cluster.run(binary("scontrol"), "release", job.id)
        cluster.run(binary("scontrol"), "update", f"JobId={job.id}", "StartTime=now")
        (task,) = finished(cluster, job)
        assert task["Restarts"] == "1", task
        summary = json.loads((job.out / "summary.json").read_text())
        assert (summary["generated_ok"], summary["skipped_complete"]) == (len(ids) - len(done), len(done))
        assert_done_once(job.out, ids, part_files=1)
    finally:
        subprocess.run(["umount", "-l", str(job.out)], check=False)


def test_single_node_two_ranks(cluster: Cluster, jobs: dict[str, Job], reference: Path) -> None:
    job = jobs["single"]
    finished(cluster, job)
    log = (job.workdir / f"cosmos3-batch-{job.id}.out").read_text()
    assert "--cpus-per-task=2" in log  # srun got the job's -c2 (22.05 no longer passes it on by itself)
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["generated_ok"] == len(IDS) and summary["failed"] == []
    assert summary["config"]["world_size"] == 2
    assert summary["config"]["offload"] == "allgather" and summary["config"]["max_active"] == 2
    assert_done_once(job.out, IDS, part_files=2)
    assert_same_outputs(reference, job.out, IDS)


def test_multi_node_four_ranks(cluster: Cluster, jobs: dict[str, Job], reference: Path) -> None:
    job = jobs["multi"]
    (task,) = finished(cluster, job)
    assert task["NumNodes"] == "2" and task["NodeList"] == "n[1-2]", task
    log = (job.workdir / f"cosmos3-batch-mn-{job.id}.out").read_text()
    assert "--rdzv-endpoint 127.0.0.1:" in log  # n1's NodeAddr: "n1" itself resolves nowhere
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["generated_ok"] == len(IDS) and summary["failed"] == []
    # Two torchruns (one per node) formed one world: every rank took part in the same passes.
    assert summary["config"]["world_size"] == 4
    assert [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert len({r["collective_trace"] for r in summary["ranks"]}) == 1
    assert_done_once(job.out, IDS, part_files=4)
    assert_same_outputs(reference, job.out, IDS)


def test_dataset_array_three_shards(cluster: Cluster, jobs: dict[str, Job], reference: Path) -> None:
    job = jobs["array"]
    tasks = finished(cluster, job)
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1", "2"]
    logs = sorted(path.name for path in job.workdir.glob("*.out"))
    assert logs == [f"cosmos3-batch-array-{job.id}_{k}.out" for k in range(3)]
    ok = 0
    for k in range(3):
        summary = json.loads((job.out / f"summary.shard{k}of3.json").read_text())
        assert summary["failed"] == [] and summary["config"]["offload"] == "local"
        assert summary["config"]["world_size"] == 1  # GPUS_PER_NODE's default without GPUs
        assert summary["generated_ok"] == sum(in_shard(rid, k, 3) for rid in IDS), k
        ok += summary["generated_ok"]
    assert ok == len(IDS)
    assert_done_once(job.out, IDS, part_files=3)
    assert_same_outputs(reference, job.out, IDS)
