"""NVIDIA sample files among the inputs of `run` and `plan` (DESIGN.md §24): which files are read as such
(`--input-format`, or detected by their keys, with a log line), their samples as request sources for
requests/parse.py, and the results given back in NVIDIA's terms: errors under the field the user wrote, at
its line, and each request knowing its sample's name. Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from cosmos3_batch.requests import cosmos_table as table
from cosmos3_batch.requests.cosmos_framework import Translation, translate
from cosmos3_batch.requests.cosmos_read import FORMATS, only_theirs, read_file
from cosmos3_batch.requests.fields import ModelLimits, RequestError
from cosmos3_batch.requests.sources import STDIN, Item, Source

log = logging.getLogger("cosmos3_batch")


@dataclass(frozen=True)
class Origin:
    name: str
    derived: bool  # the name came from the file
    given: frozenset[str]  # the sample's own keys
    translation: Translation


@dataclass
class SampleSource(Source):
    origins: dict[int, Origin] = field(default_factory=dict)  # item line -> its sample
    refused: list[RequestError] = field(default_factory=list)
    bad_lines: set[int] = field(default_factory=set)  # samples refused before this tool's checks
    refused_fields: set[tuple[int, str | None]] = field(default_factory=set)  # (item line, NVIDIA field)
    key_lines: dict[str, int] = field(default_factory=dict)


def is_theirs(path: str, input_format: str) -> bool:
    """Whether `path` is read as NVIDIA samples: by --input-format, or (auto) by keys only they have."""
    if input_format not in FORMATS:
        raise ValueError(f"--input-format must be one of {', '.join(FORMATS)}, got {input_format!r}")
    if input_format != "auto" or path == STDIN:
        return input_format == "cosmos-framework"
    keys = only_theirs(path)
    if keys:
        log.info(
            "%s: read as NVIDIA cosmos-framework samples (--input-format cosmos-framework): its keys %s are "
            "that format's and not this tool's", path, ", ".join(keys)
        )  # fmt: skip
    return bool(keys)


def read_samples(path: str, limits: ModelLimits) -> SampleSource:
    if path == STDIN:
        source = SampleSource("<stdin>", os.getcwd())
        source.problem = "NVIDIA's samples are files (.json, .jsonl, .yaml): their names come from the file's"
        return source
    found = read_file(path)
    source = SampleSource(path, os.path.dirname(os.path.abspath(path)), problem=found.problem)
    source.key_lines = found.key_lines
    for sample in found.samples:
        if sample.obj is None:
            source.items.append(Item(sample.line, None, sample.problem))
            continue
        translation = translate(sample.obj, sample.name, source.base_dir, limits)
        source.origins[sample.line] = Origin(sample.name, sample.derived, frozenset(sample.obj), translation)
        for key, message in translation.errors:
            line = source.key_lines.get((key or "").split(".")[0], sample.line)
            source.refused.append(RequestError(line, key, message, source=path))
            source.refused_fields.add((sample.line, key))
        if translation.errors:
            source.bad_lines.add(sample.line)
        if translation.mode is not None:  # the rest is still checked, so one run names every problem
            source.items.append(Item(sample.line, translation.obj))
    return source


def settle(
    sources: list[Source], requests: list, errors: list[RequestError]
) -> tuple[list, list[RequestError]]:
    """Requests of refused samples dropped, the others named after their sample; errors in NVIDIA's terms."""
    theirs = {s.name: s for s in sources if isinstance(s, SampleSource)}
    if not theirs:
        return requests, errors
    kept = []
    for request in requests:
        source = theirs.get(request.source)
        if source is None:
            kept.append(request)
        elif request.line not in source.bad_lines:
            kept.append(dataclasses.replace(request, sample=source.origins[request.line].name))
    named = []
    for error in errors:
        source = theirs.get(error.source)
        if source is None:
            named.append(error)
        elif (error.line, (renamed := _named(error, source)).field) not in source.refused_fields:
            named.append(renamed)  # a field refused already is not reported twice
    order = {s.name: index for index, s in enumerate(sources)}
    named += [error for source in theirs.values() for error in source.refused]
    named.sort(key=lambda error: (order.get(error.source, -1), error.line))
    return kept, named


def _named(error: RequestError, source: SampleSource) -> RequestError:
    origin = source.origins.get(error.line)
    key, message = error.field, error.message
    if origin is not None and key is not None:
        key = table.THEIRS.get(key, key)
        for ours, file_key in (("prompt", "prompt_path"), ("negative_prompt", "negative_prompt_file")):
            if key == ours and ours not in origin.given and file_key in origin.given:
                key = file_key
        if key == "control":
            key = next((hint for hint in table.HINTS if hint in origin.given), key)
        if error.field == "id" and message.startswith("duplicate id"):
            how = " (derived from the file name, as NVIDIA's CLI derives it)" if origin.derived else ""
            message = "duplicate name" + message.removeprefix("duplicate id").replace(":", how + ":", 1)
    line = source.key_lines.get((key or "").split(".")[0], error.line)
    return dataclasses.replace(error, line=line, field=key, message=message)


def mappings(paths: list[str], limits: ModelLimits, input_format: str) -> list[dict[str, Any]]:
    """Each NVIDIA sample's mapping, for `plan --json`: its name, file and line, the request it becomes in
    this tool's format, the fields NVIDIA's defaults filled, and what differs from NVIDIA's CLI."""
    out = []
    for path in paths:
        if not is_theirs(path, input_format) or path == STDIN:
            continue
        source = read_samples(path, limits)
        for line, origin in source.origins.items():
            out.append({"name": origin.name, "file": path, "line": line, **origin.translation.record()})
    return out
