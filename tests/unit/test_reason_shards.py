"""Reasoner requests under `--format webdataset` (issue 44 item 5): their samples go to shards of their own
kind, `shards/reason/`, named as every kind's are, each sample keyed by the request id with the generated
text (`txt`), the sidecar (`json`) and the prompt (`prompt.txt`), beside a T2I request's `image-latents`
shard. Read back with the real `webdataset` and HF `datasets`, the text and token ids equal what a
`--format files` run of the same requests writes; a rerun generates nothing and adds no sample, and one new
request gets its own shard."""

from __future__ import annotations

import csv
import json
import shutil
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds
from datasets import load_dataset

from tests.conftest import write_jsonl
from tests.unit.test_datasets import run, tars

T2I = {"id": "t2i", "prompt": "a red cube", "size": "32x32", "num_frames": 1, "num_inference_steps": 1}
T2I |= {"caption_instruction": True}  # its chained caption: a member of its own, `caption.txt`
FLAGS = ("--caption-max-new-tokens", "3")
SAMPLED = {"do_sample": True, "top_k": 20, "temperature": 0.8, "max_new_tokens": 5}


def _rows(image: str) -> list[dict]:
    return [
        T2I,
        {
            "id": "r.a",
            "prompt": "Describe a kitchen.",
            "reason": {"max_new_tokens": 6, "system": "Be brief."},
        },
        {"id": "r2", "prompt": "Rate it 1-5.", "seed": 3, "reason": SAMPLED},
        {"id": "r3", "prompt": "What is shown?", "image": image, "reason": {"max_new_tokens": 4}},
    ]


REASONED = ["r.a", "r2", "r3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_reasoner_ckpt, cond_image):
    folder = tmp_path_factory.mktemp("reason-shards")
    prompts = write_jsonl(folder / "p.jsonl", _rows(str(cond_image)))
    for fmt in ("files", "webdataset"):  # (--save-latents: run() asks for them; a reasoner's text has none)
        result = run(prompts, tiny_reasoner_ckpt, folder / fmt, "--format", fmt, *FLAGS)
        assert result.exit_code == 0, result.output
    return folder


def test_reason_samples_are_read_back_equal_to_the_files_run(runs):
    files, out = runs / "files", runs / "webdataset"
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["image-latents", "reason"]
    urls = tars(out, "reason")
    assert [u.rsplit("/", 1)[1] for u in urls] == ["rank0-000001.tar"]
    with tarfile.open(urls[0]) as tar:  # a sample's members together, its text first
        names = tar.getnames()
    key = names[0].split(".")[0]
    assert len(names) == 9 and names[:3] == [f"{key}.txt", f"{key}.json", f"{key}.prompt.txt"]
    seen = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        sidecar = json.loads(sample["json"])
        rid = sidecar["id"]
        seen[rid] = sample["__url__"].rsplit("/", 1)[1]
        assert sample["__key__"] == rid.replace(".", "%2E")
        assert sample["txt"] == (files / f"{rid}.txt").read_bytes(), rid  # the generated text, byte for byte
        expected = json.loads((files / f"{rid}.json").read_text())
        assert sidecar["reason"] == expected["reason"], rid  # the same token ids, counts and stop reason
        assert sidecar["reason"]["generated_tokens"] > 0
        assert sample["prompt.txt"].decode() == expected["request"]["prompt"] == sidecar["request"]["prompt"]
        assert sidecar["kind"] == "reason" and sidecar["shard"] == f"shards/reason/{seen[rid]}"
        assert sidecar["files"] == {
            "media": {"name": f"{sample['__key__']}.txt", "bytes": len(sample["txt"])}
        }
        assert (sidecar["reason"]["vision_tokens"] > 0) == (rid == "r3")  # the one with an image
    assert sorted(seen) == REASONED
    hf = load_dataset("webdataset", data_files={"train": urls}, split="train")
    # (HF datasets infers the json's columns from the first shard's first 5 samples: "r3"'s image is among
    # them, else its string would not cast to the null the others have; docs/outputs.md)
    assert hf.num_rows == 3 and set(hf.column_names) == {"txt", "json", "prompt.txt", "__key__", "__url__"}
    with open(out / "metrics.csv") as f:
        metrics = {row["id"]: row for row in csv.DictReader(f)}
    for rid in REASONED:
        key = rid.replace(".", "%2E")
        assert metrics[rid]["output"] == f"shards/reason/{seen[rid]}/{key}.txt", rid
        assert metrics[rid]["kind"] == "reason" and metrics[rid]["status"] == "ok"
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert {manifest[rid]["member"] for rid in REASONED} == {"r%2Ea.txt", "r2.txt", "r3.txt"}
    (image,) = wds.WebDataset(tars(out, "image-latents"), shardshuffle=False)
    caption = json.loads((files / "t2i.json").read_text())["captions"]["caption"]["text"]
    assert image["caption.txt"].decode() == caption and image["txt"].decode() == T2I["prompt"]
    assert image["png"] == (files / "t2i.png").read_bytes()
    assert manifest["t2i"]["member"] == "t2i.png" and manifest["r2"]["path"] == f"shards/reason/{seen['r2']}"


def test_a_rerun_adds_no_sample_and_a_new_request_gets_its_own_shard(runs, tiny_reasoner_ckpt, cond_image):
    out = shutil.copytree(runs / "webdataset", runs / "rerun")
    prompts = runs / "p.jsonl"
    before = {u: Path(u).read_bytes() for u in tars(out, "reason")}
    again = run(prompts, tiny_reasoner_ckpt, out, "--format", "webdataset", *FLAGS)
    assert again.exit_code == 0 and "0 generated" in again.output and "4 already complete" in again.output
    assert {u: Path(u).read_bytes() for u in tars(out, "reason")} == before  # not one byte rewritten
    files = run(
        prompts, tiny_reasoner_ckpt, runs / "files", *FLAGS
    )  # files too: --save-latents asks a text for none
    assert files.exit_code == 0 and "0 generated" in files.output and "4 already complete" in files.output
    more = write_jsonl(
        runs / "more.jsonl", [*_rows(str(cond_image)), {"id": "r4", "prompt": "Name a color.", "reason": {}}]
    )
    added = run(more, tiny_reasoner_ckpt, out, "--format", "webdataset", *FLAGS)
    assert added.exit_code == 0 and "1 generated" in added.output, added.output
    urls = tars(out, "reason")
    assert [u.rsplit("/", 1)[1] for u in urls] == ["rank0-000001.tar", "rank0-000002.tar"]
    keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
    assert sorted(keys) == ["r%2Ea", "r2", "r3", "r4"]  # each id once
