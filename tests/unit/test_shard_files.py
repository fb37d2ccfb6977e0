"""WebDataset shards at the level of their files, without a model: a kill between a shard's index and its
rename (in a finalize and in a rewrite) loses nothing and leaves no id twice, and a writer's memory does not
grow with its shard. (What a run writes, read by the real loaders: test_datasets.py.)"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pyarrow.parquet as pq

from cosmos3_batch.io.dataset import Dataset, write_record
from cosmos3_batch.io.manifest import write_manifest
from cosmos3_batch.io.metrics import state_dir
from cosmos3_batch.io.shard_index import drop_superseded, read_indexes, remove_stale
from cosmos3_batch.io.shards import ShardWriter


def add(writer: ShardWriter, rid: str, text: str = "") -> list:
    member = writer.stage(rid, "txt")
    member.write_text(text or rid)
    return writer.add("t", rid, [("txt", member)], {"id": rid}, {"id": rid})


def killed_at_the_rename(step, temporary: str = ".tar.tmp") -> None:
    """Run `step` in a child process that dies (no clean-up of any kind) as it renames a shard's temporary
    into place: after the index is written, before the rename, as a SIGKILL there leaves it. `temporary`
    ".tmp.json": as it renames the index's temporary into place, before the index exists."""
    pid = os.fork()
    if pid == 0:
        try:
            real = os.replace

            def replace(src, dst):
                if str(src).endswith(temporary):
                    os._exit(17)
                real(src, dst)

            os.replace = replace  # this child's only
            step()
        finally:
            os._exit(1)  # the step got past the rename: the test is wrong
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17


def members(out: Path) -> dict[str, list[str]]:
    found = {}
    for index in read_indexes(out):
        with tarfile.open(out / index["shard"]) as tar:
            found[index["shard"]] = tar.getnames()
        assert [f"{s['id']}.txt" for s in index["samples"]] == found[index["shard"]]
    return found


def test_a_kill_between_the_index_and_the_rename_of_a_finalize_keeps_the_shard(tmp_path):
    def finalize():
        writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=2)
        add(writer, "a")
        add(writer, "b")  # the shard is full: finalized, killed at its rename

    killed_at_the_rename(finalize)
    assert read_indexes(tmp_path) == [] and list((tmp_path / "shards/t").glob(".rank0-000001.*.tar.tmp"))
    assert remove_stale(tmp_path, "") == 0  # the temporary is what its index records: renamed, not deleted
    assert members(tmp_path) == {"shards/t/rank0-000001.tar": ["a.txt", "b.txt"]}
    assert not list((tmp_path / "shards/t").glob(".*"))


def test_a_kill_between_the_index_and_the_rename_of_a_rewrite_leaves_no_id_twice(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=2)
    add(writer, "a")
    add(writer, "b")
    add(writer, "a", "a again")  # a newer sample of a: the first shard's is superseded
    writer.close()
    killed_at_the_rename(lambda: drop_superseded(tmp_path, ""))
    # The killed rewrite's index records its temporary, the old tar (a twice) is still under its name.
    assert [i["shard"] for i in read_indexes(tmp_path)] == ["shards/t/rank0-000002.tar"]
    assert remove_stale(tmp_path, "") == 0
    kept = members(tmp_path)
    assert kept == {"shards/t/rank0-000001.tar": ["b.txt"], "shards/t/rank0-000002.tar": ["a.txt"]}


def test_an_index_a_kill_left_half_written_is_never_read_as_the_index_of_a_later_shard(tmp_path):
    """A finalize killed as it renamed its index's temporary into place leaves that temporary (hidden, named
    `.rank0-000001.PID.*.tmp.json`) and an unrecorded tar temporary. The rerun deletes both and writes shard
    000001 again, the same size. Found in test_resume under load: the index's temporary stayed, `read_indexes`
    (a `*.json` glob) took it for a second index of the new tar, and the end's rewrite copied members at its
    offsets from the new tar (one sample's bytes under another's name) over the real index (a sample lost)."""

    def finalize():
        writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=2)
        add(writer, "a")
        add(writer, "b")  # full: finalized, killed as its index is renamed into place

    killed_at_the_rename(finalize, ".tmp.json")
    index_dir = state_dir(tmp_path) / "shards/t"
    (left,) = index_dir.iterdir()  # the index's temporary, and nothing else
    assert left.name.startswith(".rank0-000001.") and read_indexes(tmp_path) == []
    text = left.read_text()
    assert remove_stale(tmp_path, "") == 1  # the run's start: the unrecorded tar temporary, and the index's
    assert not list(index_dir.iterdir()) and not list((tmp_path / "shards/t").iterdir())
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=2)
    for rid in ("c", "a", "b"):  # nothing was finalized: all three again, shard 000001 = c, a (same size)
        add(writer, rid)
    writer.close()
    left.write_text(text)  # as the temporary stayed before remove_stale knew it: still never an index
    assert [i["shard"] for i in read_indexes(tmp_path)] == [
        "shards/t/rank0-000001.tar",
        "shards/t/rank0-000002.tar",
    ]
    drop_superseded(tmp_path, "")
    assert members(tmp_path) == {
        "shards/t/rank0-000001.tar": ["c.txt", "a.txt"],
        "shards/t/rank0-000002.tar": ["b.txt"],
    }


def test_a_temporary_its_index_does_not_record_is_deleted(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=0)
    add(writer, "a")  # the open shard of a killed run: no index
    assert remove_stale(tmp_path, "") == 1
    assert not list((tmp_path / "shards/t").iterdir()) and read_indexes(tmp_path) == []


def test_a_writers_tar_keeps_no_member_list(tmp_path, monkeypatch):
    # tarfile's TarFile.addfile keeps every TarInfo it wrote: 100,000s for a 1 GB shard of small images.
    kept = []
    close = tarfile.TarFile.close
    monkeypatch.setattr(tarfile.TarFile, "close", lambda tar: kept.append(len(tar.members)) or close(tar))
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=3)
    for rid in ("s0", "s1", "s2", "s0"):
        add(writer, rid)
    assert writer._open["t"].tar.members == []
    writer.close()
    drop_superseded(tmp_path, "")  # s0 again: the first shard rewritten without it
    assert kept == [0, 0, 0]  # two shards written, one rewritten: none kept a member list
    assert members(tmp_path) == {"shards/t/rank0-000001.tar": ["s1.txt", "s2.txt"],
                                 "shards/t/rank0-000002.tar": ["s0.txt"]}  # fmt: skip


def test_a_runs_end_reads_each_shard_index_once(tmp_path, monkeypatch):
    # Dropping superseded samples and building the manifest share one reading of the indexes.
    write_record(state_dir(tmp_path).parent, Dataset("webdataset", "flat"))
    writer = ShardWriter(tmp_path, rank=0, tag="", max_bytes=0, max_samples=2)
    for rid in ("a", "b", "a"):  # a again: the first shard is rewritten without it
        add(writer, rid)
    writer.close()
    read = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: read.append(p.name) or real(p, *a, **k))
    write_manifest(tmp_path, tag="")
    assert sorted(n for n in read if n.startswith("rank")) == ["rank0-000001.json", "rank0-000002.json"]
    monkeypatch.undo()
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "manifest.parquet").to_pylist()}
    assert {rid: row["path"] for rid, row in rows.items()} == {
        "a": "shards/t/rank0-000002.tar",
        "b": "shards/t/rank0-000001.tar",
    }
    rewritten = {i["shard"]: i["samples"] for i in read_indexes(tmp_path)}["shards/t/rank0-000001.tar"]
    assert json.loads(rows["b"]["files"]) == rewritten[0]["members"]  # its offset in the rewritten tar
