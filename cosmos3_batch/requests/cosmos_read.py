"""Reading NVIDIA cosmos-framework sample files as its CLI reads them (DESIGN.md §24): a `.json` holds one
sample, a `.jsonl` one per non-empty line, a `.yaml`/`.yml` one. A sample's `name` is its own, else the
file's stem (`<stem>_<i>` for JSONL, i counting the non-empty lines from 0), as `SampleOverrides.from_files`
derives it. Also the detection of such files among this tool's own (`--input-format auto`). Torch-free.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from cosmos3_batch.requests.cosmos_table import KNOWN
from cosmos3_batch.requests.fields import ALLOWED_KEYS, JsonObject, NonFinite, describe
from cosmos3_batch.requests.sources import _object_from_pairs, parse_object

SUFFIXES = (".json", ".jsonl", ".yaml", ".yml")
FORMATS = ("auto", "cosmos3-batch", "cosmos-framework")


@dataclass
class Sample:
    line: int  # where it starts: its line in a JSONL, 1 in a JSON or YAML file
    name: str  # its `name`, or the one derived from the file
    derived: bool  # the name came from the file, not the sample
    obj: dict[str, Any] | None
    problem: str | None = None


@dataclass
class SampleFile:
    path: str
    samples: list[Sample] = field(default_factory=list)
    key_lines: dict[str, int] = field(default_factory=dict)  # a one-sample file: top-level key -> its line
    problem: str | None = None


def read_file(path: str) -> SampleFile:
    """Decode one sample file; never raises for what is in it (problems are on the samples or the file)."""
    found = SampleFile(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        found.problem = (
            f"NVIDIA's CLI reads .json, .jsonl, .yaml and .yml sample files, not {suffix or path!r}"
        )
        return found
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        found.problem = f"cannot read sample file: {getattr(exc, 'strerror', None) or exc}"
        return found
    stem = os.path.splitext(os.path.basename(path))[0]
    if suffix == ".jsonl":
        found.samples = list(_jsonl_samples(text, stem))
    else:
        obj, problem, found.key_lines = _yaml_doc(text) if suffix != ".json" else _json_doc(text)
        found.samples = [_named(1, obj, problem, stem)]
    if not found.samples:
        found.problem = "no samples in file"
    return found


def _named(line: int, obj: Any, problem: str | None, default: str) -> Sample:
    if problem is None and not isinstance(obj, dict):
        problem = f"a sample must be an object, got {describe(obj)}"
    if problem is not None:
        return Sample(line, default, True, None, problem)
    name = obj.get("name")
    return Sample(line, name, False, obj) if name is not None else Sample(line, default, True, obj)


def _jsonl_samples(text: str, stem: str):
    index = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw:  # NVIDIA's reader skips empty lines only (and counts the others for the names)
            continue
        obj, problem = parse_object(raw)
        yield _named(number, obj, problem, f"{stem}_{index}")
        index += 1


def _json_doc(text: str) -> tuple[Any, str | None, dict[str, int]]:
    try:
        obj = json.loads(text, parse_constant=NonFinite, object_pairs_hook=_object_from_pairs)
    except (ValueError, RecursionError) as exc:
        return None, f"not valid JSON: {exc}", {}
    lines: dict[str, int] = {}
    if isinstance(obj, dict):
        for key in obj:
            match = re.search(rf'"{re.escape(key)}"\s*:', text)
            lines[key] = text.count("\n", 0, match.start()) + 1 if match else 1
    return obj, None, lines


def _yaml_doc(text: str) -> tuple[Any, str | None, dict[str, int]]:
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        obj = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return None, f"not valid YAML: {exc}".replace("\n", " "), {}
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        keys = [key for key, _ in node.value]
        lines = {key.value: key.start_mark.line + 1 for key in keys if isinstance(key, yaml.ScalarNode)}
        if len(keys) > len(lines):  # a repeated key: YAML keeps the last, NVIDIA's CLI sees one
            obj = JsonObject(obj)
            obj.duplicates = tuple(
                sorted({k.value for k in keys if [x.value for x in keys].count(k.value) > 1})
            )
    return obj, None, lines


def only_theirs(path: str) -> list[str] | None:
    """The keys that make `path` an NVIDIA sample file, when its first sample's keys are all NVIDIA's and
    some are not this tool's; None when the file can be (or is) this tool's own format."""
    if os.path.splitext(path)[1].lower() not in SUFFIXES:
        return None
    found = read_first(path)
    if found is None or not found or not set(found) <= KNOWN:
        return None
    theirs = sorted(set(found) - set(ALLOWED_KEYS))
    return theirs or None


def read_first(path: str) -> dict[str, Any] | None:
    """The first sample's object (a JSONL's first line only: detection must not read a million lines)."""
    if path.lower().endswith(".jsonl"):
        try:
            with open(path, encoding="utf-8-sig") as f:
                first = next((line for line in f if line.strip()), "")
        except (OSError, UnicodeDecodeError):
            return None
        return parse_object(first)[0]
    found = read_file(path)
    obj = found.samples[0].obj if found.samples else None
    return obj if isinstance(obj, dict) else None
