"""Datasets a training pipeline reads (DESIGN.md §12), through the real `run` in this process and the real
consumers of what it writes: WebDataset shards read by `webdataset` and HF `datasets` (bit-exact with the
files of a `--format files` run), manifest.parquet read by pandas and HF `datasets`, resume from the shard
indexes, `status`, the nested layout (resume, report, manifest follow it), a rerun that regenerates
samples leaving no id twice, and a full disk mid-shard (exit 75, nothing partial under a final name, the
rerun does exactly the rest). The kill mid-shard runs under torchrun in tests/dist/test_resume.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds
from datasets import load_dataset
from safetensors.torch import load
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io.dataset import Dataset, choose, parse_shard_size, write_record
from cosmos3_batch.io.shard_index import read_indexes
from cosmos3_batch.io.shards import ShardWriter
from cosmos3_batch.io.status import last_runs
from tests.conftest import write_jsonl
from tests.unit.test_faults import fill, tmpfs

ROWS = [
    {"id": "img.a" if i == 0 else f"d{i}", "prompt": f"a red cube {i}", "size": "32x32", "seed": i}
    | {"num_frames": 5 if i % 3 == 2 else 1, "num_inference_steps": 1 + i % 2}
    for i in range(7)
]
IDS = sorted(r["id"] for r in ROWS)
KINDS = {"image-latents": ["d1", "d3", "d4", "d6", "img.a"], "video-latents": ["d2", "d5"]}


def invoke(*args) -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks: the references run alike
    try:
        return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)


def run(prompts, ckpt, out, *flags) -> object:
    return invoke("run", prompts, "--model", ckpt, "--out", out, "--save-latents", "--no-progress", *flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_ckpt) -> dict:
    folder = tmp_path_factory.mktemp("datasets")
    prompts = write_jsonl(folder / "p.jsonl", ROWS)
    found = {"prompts": prompts, "files": folder / "files", "shards": folder / "shards"}
    assert run(prompts, tiny_ckpt, found["files"]).exit_code == 0
    result = run(prompts, tiny_ckpt, found["shards"], "--format", "webdataset", "--shard-size", "2")
    assert result.exit_code == 0, result.output
    return found


def tars(out: Path, kind: str) -> list[str]:
    return [str(p) for p in sorted((out / "shards" / kind).glob("*.tar"))]


def names(shard) -> list[str]:
    with tarfile.open(shard) as tar:
        return tar.getnames()


def test_shards_are_read_by_webdataset_and_hf_datasets_bit_exact_with_files(runs):
    ref, out = runs["files"], runs["shards"]
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(KINDS)
    for kind, ids in KINDS.items():
        urls = tars(out, kind)
        # --shard-size 2: full shards of two samples, the last one closed at the end.
        assert [len(names(u)) for u in urls] == [8] * (len(ids) // 2) + [4] * (len(ids) % 2)
        seen = []
        for sample in wds.WebDataset(urls, shardshuffle=False):
            sidecar = json.loads(sample["json"])
            rid = sidecar["id"]
            seen.append(rid)
            assert sample["__key__"] == rid.replace(".", "%2E")  # loaders cut names at the first dot
            assert sample["txt"].decode() == sidecar["request"]["prompt"]
            expected = load((ref / f"{rid}.latents.safetensors").read_bytes())["latents"]
            assert torch.equal(load(sample["latents.safetensors"])["latents"], expected), rid
            if "png" in sample:
                assert sample["png"] == (ref / f"{rid}.png").read_bytes(), rid
            else:
                assert sample["mp4"][4:8] == b"ftyp"
        assert sorted(seen) == ids
        hf = load_dataset("webdataset", data_files={"train": urls}, split="train")
        media = "png" if kind.startswith("image") else "mp4"
        assert hf.num_rows == len(ids)
        assert set(hf.column_names) == {media, "json", "txt", "latents.safetensors", "__key__", "__url__"}


def test_manifest_is_read_by_pandas_and_hf_datasets(runs):
    for fmt in ("files", "shards"):
        out = runs[fmt]
        frame = pd.read_parquet(out / "manifest.parquet")
        assert list(frame["id"]) == IDS and set(frame["status"]) == {"ok"}
        assert set(frame["format"]) == {"files" if fmt == "files" else "webdataset"}
        by_id = {r["id"]: r for r in ROWS}
        for row in frame.itertuples():
            assert (row.prompt, row.seed, row.num_frames) == (
                by_id[row.id]["prompt"],
                by_id[row.id]["seed"],
                by_id[row.id]["num_frames"],
            )
            assert (row.width, row.height, row.steps, row.rank) == (
                32,
                32,
                by_id[row.id]["num_inference_steps"],
                0,
            )
            assert len(row.model_digest) >= 16 and pd.isna(row.error) and row.denoise_s >= 0
            if fmt == "files":
                assert row.path == f"{row.id}.{'png' if row.num_frames == 1 else 'mp4'}" and pd.isna(
                    row.member
                )
                assert (out / row.path).is_file()
            else:
                assert row.member in names(out / row.path)
        hf = load_dataset("parquet", data_files=str(out / "manifest.parquet"), split="train")
        assert hf.num_rows == len(IDS) and hf[0]["id"] == IDS[0]


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of a run's OUT whose files keep their inodes (hard links: the manifest and the shard indexes
    recorded them); the part files a run appends to are copied, and every other file is replaced by a
    rename, so nothing of `src` changes."""
    shutil.copytree(src, dst, copy_function=os.link)
    for part in (dst / ".cosmos3_batch").glob("*.csv"):
        part.unlink()
        shutil.copy2(src / ".cosmos3_batch" / part.name, part)
    return dst


def rewrite_keeping_mtime(path: Path, text: str) -> None:
    """A new file renamed over `path` (as every writer of ours writes), with the old one's mtime."""
    st = path.stat()
    new = path.with_name(f".{path.name}.new")
    new.write_text(text)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)


def test_a_rerun_manifest_reuses_the_rows_of_unchanged_sidecars(runs, monkeypatch, tmp_path):
    from cosmos3_batch.io import catalog
    from cosmos3_batch.io.manifest import build_manifest

    out = linked_copy(runs["files"], tmp_path / "copy")
    read = []
    real = catalog._sidecar
    monkeypatch.setattr(catalog, "_sidecar", lambda path: read.append(path.name) or real(path))
    again = build_manifest(out)
    assert read == ["summary.json"]  # no request's sidecar read: each row reused by its stamp
    assert again.equals(pq.read_table(out / "manifest.parquet"))
    # A changed sidecar is read again, even with the mtime set back: a rewrite is a rename (another inode).
    rewrite_keeping_mtime(out / "d2.json", (out / "d2.json").read_text())
    read.clear()
    build_manifest(out)
    assert sorted(read) == ["d2.json", "summary.json"]


def test_a_rerun_checks_files_against_the_manifest_without_reading_sidecars(runs, tiny_ckpt, tmp_path):
    out = linked_copy(runs["files"], tmp_path / "copy")
    # d2's sidecar replaced (a rename) by one of another request, of the same size, its mtime set back.
    other = json.loads((out / "d2.json").read_text()) | {"request_hash": "0" * 64}
    other = json.dumps(other, indent=2, sort_keys=True) + "\n"  # as outputs.write_json writes it
    assert len(other) == (out / "d2.json").stat().st_size
    sidecars = {f"{rid}.json" for rid in IDS}
    read: list[str] = []
    real = Path.read_text

    def counting(path, *args, **kwargs):
        if path.name in sidecars:
            read.append(path.name)
        return real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "read_text", counting)
        assert f"{len(IDS)} already complete" in run(runs["prompts"], tiny_ckpt, out).output
        assert read == []  # every sidecar unchanged since the manifest: its recorded content is used
        (out / "d1.png").unlink()  # ... and every file it lists is still checked on disk
        rewrite_keeping_mtime(out / "d2.json", other)  # a sidecar changed since: read again (another inode)
        again = run(runs["prompts"], tiny_ckpt, out)
    assert f"2 generated, 0 failed, {len(IDS) - 2} already complete" in again.output
    # d2's changed sidecar: read by the resume check; d1's and d2's new ones: by the manifest.
    assert sorted(read) == ["d1.json", "d2.json", "d2.json"]
    assert (out / "d1.png").read_bytes() == (runs["files"] / "d1.png").read_bytes()
    assert (out / "d2.mp4").read_bytes() == (runs["files"] / "d2.mp4").read_bytes()


def test_resume_status_and_overwrite_from_the_shard_indexes(runs, tiny_ckpt, tmp_path):
    # A linked copy: the fixture's OUT is shared by tests a worker may run in any order (worksteal).
    out, prompts = linked_copy(runs["shards"], tmp_path / "copy"), runs["prompts"]
    # A kill between a shard's index and its rename: the index records the temporary (the same inode).
    shard = Path(tars(out, "video-latents")[0])
    shard.rename(shard.with_name(f".{shard.stem}.999.tar.tmp"))
    # No --format: the rerun follows what OUT holds (and takes --shard-size); the rename is finished first.
    again = run(prompts, tiny_ckpt, out, "--shard-size", "2")
    assert f"0 generated, 0 failed, {len(IDS)} already complete" in again.output, again.output
    assert tars(out, "video-latents")[0] == str(shard) and not list(shard.parent.glob(".*"))
    layout = invoke("run", prompts, "--out", out, "--layout", "nested")  # a files setting: refused
    assert layout.exit_code == 2 and "--layout applies to --format files only" in layout.output
    status = invoke("status", out, "--json")
    assert status.exit_code == 0 and json.loads(status.output)["done"] == len(IDS)
    more = write_jsonl(tmp_path / "more.jsonl", [*ROWS, {"id": "new", "prompt": "x", "size": "32x32"}])
    pending = invoke("status", out, "--input", more, "--json")
    report = json.loads(pending.output)
    assert pending.exit_code == 3 and (report["done"], report["pending"], report["all_done"]) == (7, 1, False)
    # Regenerated samples replace the earlier ones: a loader never reads an id twice.
    assert run(prompts, tiny_ckpt, out, "--format", "webdataset", "--overwrite").exit_code == 0
    keys = [s["__key__"] for kind in KINDS for s in wds.WebDataset(tars(out, kind), shardshuffle=False)]
    assert sorted(keys) == sorted(i.replace(".", "%2E") for i in IDS)
    assert sum(len(i["samples"]) for i in read_indexes(out)) == len(IDS)


def test_a_copied_webdataset_folder_keeps_its_shards_for_resume_status_and_manifest(
    runs, tiny_ckpt, tmp_path
):
    copy = tmp_path / "copy"
    shutil.copytree(runs["shards"], copy)  # new inodes: what cp -r, rsync or another filesystem gives
    assert sum(len(i["samples"]) for i in read_indexes(copy)) == len(IDS)
    status = invoke("status", copy, "--json")
    assert status.exit_code == 0 and json.loads(status.output)["done"] == len(IDS)
    again = run(runs["prompts"], tiny_ckpt, copy)
    assert f"0 generated, 0 failed, {len(IDS)} already complete" in again.output, again.output
    # ... but while a shard's rename is pending (its temporary beside it), its old tar is not read.
    shard = Path(tars(copy, "video-latents")[0])
    (shard.parent / f".{shard.stem}.1.tar.tmp").write_bytes(b"")
    assert sum(len(i["samples"]) for i in read_indexes(copy)) < len(IDS)


def test_lost_metrics_rows_are_recovered_naming_the_media(runs, tmp_path):
    from cosmos3_batch.config import RunConfig
    from cosmos3_batch.io import dataset
    from cosmos3_batch.io.metrics import MetricsWriter, read_part
    from cosmos3_batch.pipeline.finish.results import ResultWriter, shard_writer
    from cosmos3_batch.requests.parse import load_requests

    requests = load_requests(str(runs["prompts"]))[0]
    for fmt in ("files", "shards"):
        out = tmp_path / fmt
        linked_copy(runs[fmt], out)
        for part in (out / ".cosmos3_batch").glob("metrics.*rank*.csv"):
            part.unlink()  # every row lost (a crash after the outputs were final)
        metrics = MetricsWriter(out, rank=0)
        cfg = RunConfig(prompts=("-",), out=out)
        shards = shard_writer(cfg, dataset.of(out), 0)
        writer = ResultWriter(cfg, Path("model"), metrics, "identity", shards=shards)
        assert writer.recover_rows(requests) == len(IDS)
        metrics.close()
        frame = pd.read_parquet(out / "manifest.parquet")
        media = {r.id: r.path + (f"/{r.member}" if fmt == "shards" else "") for r in frame.itertuples()}
        assert {row["id"]: row["output"] for row in read_part(metrics.path)[0]} == media
        assert all(Path(path).suffix in (".png", ".mp4") for path in media.values())


class TwoRanks:
    """The collectives `_plan_everywhere` issues, for one rank of a world of two run one after the other:
    rank 0's broadcast is kept for rank 1; gathers return this rank's object twice."""

    sent: object = None

    def __init__(self, rank: int):
        import torch

        self.rank, self.world_size, self.distributed, self.is_main = rank, 2, True, rank == 0
        self.device = torch.device("cpu")  # the plan check reads its memory (none on the CPU device)

    def all_gather_object(self, obj) -> list:
        return [obj, obj]

    def broadcast_object(self, obj):
        if self.is_main:
            TwoRanks.sent = obj
        return TwoRanks.sent


def test_only_rank_0_reads_out_for_resume_and_the_others_take_its_split(runs, tiny_ckpt, tmp_path):
    from cosmos3_batch.config import make_config
    from cosmos3_batch.pipeline.job import run as job

    out = linked_copy(runs["shards"], tmp_path / "copy")
    more = write_jsonl(tmp_path / "more.jsonl", [*ROWS, {"id": "new", "prompt": "x", "size": "32x32"}])
    cfg = make_config("allgather", None, prompts=str(more), out=out, model=tiny_ckpt)
    first, _ = job._plan_everywhere(cfg, TwoRanks(0))  # (the plan, the device memory: none on CPU)
    with pytest.MonkeyPatch.context() as patch:  # rank 1 neither reads OUT nor tokenizes
        patch.setattr(job, "split_complete", lambda *a: pytest.fail("rank 1 read OUT"))
        patch.setattr(job, "token_errors", lambda *a: pytest.fail("rank 1 tokenized"))
        second, _ = job._plan_everywhere(cfg, TwoRanks(1))
    assert [r.id for r in first.requests] == [r.id for r in second.requests] == ["new"]
    assert [r.id for r in first.complete] == [r.id for r in second.complete] == [r["id"] for r in ROWS]
    assert first.invalid == second.invalid == []


def test_nested_layout_is_followed_by_resume_report_and_manifest(runs, tiny_ckpt, tmp_path):
    out, prompts = tmp_path / "nested", runs["prompts"]
    assert run(prompts, tiny_ckpt, out, "--layout", "nested").exit_code == 0
    assert not list(out.glob("*.png")) and len(list(out.glob("[0-9a-f][0-9a-f]/*.json"))) == len(IDS)
    assert "already complete" in run(prompts, tiny_ckpt, out).output  # the record keeps the layout
    wrong = run(prompts, tiny_ckpt, out, "--layout", "flat")
    assert wrong.exit_code == 2 and "holds a nested layout" in wrong.output
    frame = pd.read_parquet(out / "manifest.parquet")
    assert all((out / p).is_file() and p.count("/") == 1 for p in frame["path"])
    assert invoke("report", out, "--no-progress").exit_code == 0
    assert len(list((out / "report" / "thumbs").glob("*.jpg"))) == len(IDS)
    assert invoke("status", out).exit_code == 0


def test_status_and_manifest_merge_the_tasks_of_an_array(runs, tiny_ckpt, tmp_path):
    out, prompts = tmp_path / "array", runs["prompts"]
    assert run(prompts, tiny_ckpt, out, "--shard", "0/2").exit_code == 0
    middle = json.loads(invoke("status", out, "--input", prompts, "--json").output)
    first = middle["array_tasks"]["0/2"]["done"]
    assert middle["array_tasks"]["1/2"] == {
        "done": 0,
        "failed": 0,
        "interrupted": 0,
        "pending": len(IDS) - first,
    }
    assert len(pd.read_parquet(out / "manifest.parquet")) == first  # what task 0 knows
    assert run(prompts, tiny_ckpt, out, "--shard", "1/2").exit_code == 0
    report = json.loads(invoke("status", out, "--input", prompts, "--json").output)
    assert report["all_done"] and report["array_tasks"]["1/2"]["done"] == len(IDS) - first
    # Each task's last run, as its summary file has it: the counters its --metrics-textfile ends with.
    assert sorted(report["runs"]) == ["summary.shard0of2.json", "summary.shard1of2.json"]
    for name, figures in report["runs"].items():
        ranks = json.loads((out / name).read_text())["ranks"]
        assert (
            (figures["passes"], figures["und_passes"])
            == (ranks[0]["passes"], ranks[0]["und_passes"])
            > (0, 0)
        )
        assert figures["weight_bytes"] == sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
    frame = pd.read_parquet(out / "manifest.parquet")  # the last task's end merged both
    assert list(frame["id"]) == IDS and set(frame["status"]) == {"ok"}
    more = write_jsonl(tmp_path / "more.jsonl", [*ROWS, {"id": "later", "prompt": "x", "size": "32x32"}])
    assert invoke("manifest", out, "--input", more).exit_code == 0
    frame = pd.read_parquet(out / "manifest.parquet")
    assert dict(zip(frame["id"], frame["status"], strict=True))["later"] == "pending" and len(frame) == 8


def test_status_runs_are_the_summary_files_alone(tmp_path):
    """A request may be called "summary2" (its sidecar is summary2.json); a torn summary is left out."""
    ranks = [{"passes": 9, "und_passes": 2, "h2d_bytes": 5, "gathered_bytes": 7, "stall_s": 0.25}] * 2
    summary = {"started_at": "2026-01-01T00:00:00Z", "wall_s": 3.0, "skipped_complete": 1, "ranks": ranks}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "summary2.json").write_text(json.dumps({"status": "complete"}))
    (tmp_path / "summary.shard1of4.json").write_text("{")
    assert last_runs(tmp_path) == {
        "summary.json": {
            "started_at": "2026-01-01T00:00:00Z",
            "wall_s": 3.0,
            "skipped": 1,
            "passes": 9,
            "und_passes": 2,
            "weight_bytes": 24,
            "stall_seconds": 0.5,
        }
    }


def test_status_and_manifest_refuse_a_folder_no_run_wrote_to(tmp_path):
    for command in ("status", "manifest"):
        result = invoke(command, tmp_path)
        assert result.exit_code == 2 and "no run has written here" in result.output, command
    assert not list(tmp_path.iterdir())


def test_the_layout_is_nested_above_10k_requests_and_kept_by_later_runs(tmp_path):
    assert choose(tmp_path, "files", None, 10_000) == Dataset("files", "flat")
    assert choose(tmp_path, "files", None, 10_001) == Dataset("files", "nested")
    assert choose(tmp_path, "webdataset", None, 10**6) == Dataset("webdataset", "flat")
    (tmp_path / ".cosmos3_batch").mkdir()
    write_record(tmp_path, Dataset("files", "flat"))
    assert choose(tmp_path, "files", None, 10**6) == Dataset("files", "flat")  # what OUT holds wins
    with pytest.raises(ValueError, match="holds files"):
        choose(tmp_path, "webdataset", None, 1)


def test_a_full_disk_mid_shard_stops_with_75_and_the_rerun_does_exactly_the_rest(runs, tiny_ckpt, tmp_path):
    ref, prompts = runs["files"], runs["prompts"]
    with tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "out"
        ballast = fill(disk, leave=40 << 10)  # room for a few samples: the disk fills inside a shard
        result = run(prompts, tiny_ckpt, out, "--format", "webdataset", "--shard-size", "3")
        assert result.exit_code == 75, result.output
        assert "ENOSPC" in result.output.strip().splitlines()[-1]
        kept = [s["id"] for i in read_indexes(out) for s in i["samples"]]
        for path in (out / "shards").rglob("*"):
            assert path.is_dir() or path.suffix == ".tar", path  # no temporary left, no partial shard
        for index in read_indexes(out):  # every finalized shard reads whole, as its index says
            with tarfile.open(out / index["shard"]) as tar:
                assert len(tar.getnames()) == 4 * len(index["samples"])
        ballast.unlink()
        again = run(prompts, tiny_ckpt, out, "--format", "webdataset", "--shard-size", "3")
        assert again.exit_code == 0, again.output
        assert f"{len(IDS) - len(kept)} generated, 0 failed, {len(kept)} already complete" in again.output
        samples = {}
        for kind in KINDS:
            for s in wds.WebDataset(tars(out, kind), shardshuffle=False):
                samples[json.loads(s["json"])["id"]] = s
        assert sorted(samples) == IDS
        rows = pd.read_csv(out / "metrics.csv")
        assert sorted(rows["id"]) == IDS and set(rows["status"]) == {"ok"}
        for rid, sample in samples.items():
            expected = load((ref / f"{rid}.latents.safetensors").read_bytes())["latents"]
            assert torch.equal(load(sample["latents.safetensors"])["latents"], expected), rid


def test_a_failed_append_leaves_no_torn_member(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=0)
    good = writer.stage("a", "txt")
    good.write_text("first")
    assert writer.add("t", "a", [(good.name.split(".", 1)[1], good)], {"id": "a"}, {}) == []
    half = writer.stage("b", "txt")
    half.write_text("second")
    with pytest.raises(FileNotFoundError):  # its second member is missing: the first is cut back off
        writer.add("t", "b", [("txt", half), ("png", tmp_path / "missing.png")], {"id": "b"}, {})
    third = writer.stage("c", "txt")
    third.write_text("third")
    writer.add("t", "c", [("txt", third)], {"id": "c"}, {})
    done, lost = writer.close()
    assert [p.sample["id"] for p in done] == ["a", "c"] and lost == []
    with tarfile.open(tmp_path / "shards/t/rank0-000001.tar") as tar:
        assert tar.getnames() == ["a.txt", "c.txt"]
    index = read_indexes(tmp_path)[0]
    raw = (tmp_path / index["shard"]).read_bytes()
    offset, size = index["samples"][1]["members"]["txt"]
    assert raw[offset : offset + size] == b"third" and not list((tmp_path / "shards/t").glob(".*"))
    assert io.BytesIO(raw).getbuffer().nbytes == index["bytes"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--format", "webdataset", "--layout", "nested"], "--layout must be one of flat, nested"),
        (["--shard-size", "1GB"], "--shard-size applies to --format webdataset only"),
        (["--format", "webdataset", "--shard-size", "12 apples"], "--shard-size must be a byte size"),
        (["--format", "tar"], "--format must be one of files, webdataset"),
    ],
)
def test_dataset_flags_are_checked_before_anything_loads(tmp_path, flags, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:1])
    result = invoke("run", prompts, "--out", tmp_path / "out", *flags)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_shard_sizes_parse_to_bytes_or_samples():
    assert parse_shard_size("1GB") == (10**9, 0)
    assert parse_shard_size("512MiB") == (512 * 2**20, 0)
    assert parse_shard_size("1000") == (0, 1000)
    assert parse_shard_size("2.5kb") == (2500, 0)
