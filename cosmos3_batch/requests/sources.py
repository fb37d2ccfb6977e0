"""Where requests come from (DESIGN.md §13): JSONL, JSON, Parquet and CSV files, globs of them, and `-`
(JSONL on standard input), each turned into decoded objects that keep their place in the file, for
requests/parse.py to check with the same field rules whatever the format.

A place is a line for JSONL and CSV (the number an editor shows), an item for a JSON array and a row for
Parquet (1-based). CSV cells are text: each is converted to its field's type here (numbers, true/false,
JSON for the structured fields) so that `"num_frames": 5` and a cell `5` are the same request. Imports no
torch; pyarrow only for a Parquet file.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cosmos3_batch.requests.fields import JsonObject, NonFinite, describe

STDIN = "-"
INT_FIELDS = frozenset(
    {"width", "height", "num_frames", "num_inference_steps", "seed", "max_sequence_length", "samples",
     "frames_per_chunk", "conditional_frames", "first_chunk_conditional_frames"}
)  # fmt: skip
FLOAT_FIELDS = frozenset({"fps", "guidance_scale", "flow_shift", "control_guidance"})
BOOL_FIELDS = frozenset({"system_prompt", "sound"})
JSON_FIELDS = frozenset(  # JSON text in a CSV cell
    {"action", "extra_params", "condition_frames", "control"}
    | {"guidance_interval", "control_guidance_interval"}
)
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


@dataclass(frozen=True)
class Item:
    """One request's object at its place (`number`), or why there is none (`problem`)."""

    number: int
    obj: JsonObject | None
    problem: str | None = None


@dataclass
class Source:
    """One input as the user named it; `unit` says what `number` counts (line, item, row)."""

    name: str
    base_dir: str  # relative `image`/`video`/action paths resolve against it
    unit: str = "line"
    items: list[Item] = field(default_factory=list)
    problem: str | None = None  # the whole input is unreadable


@dataclass(frozen=True)
class Columns:
    """Table columns holding the prompt and the id under other names (`--prompt-column`, `--id-column`)."""

    prompt: str | None = None
    id: str | None = None

    def rename(self, obj: JsonObject) -> str | None:
        """Move the named columns to their fields in place; a problem if both names are present."""
        for target, column in (("prompt", self.prompt), ("id", self.id)):
            if column is None or column == target or column not in obj:
                continue
            if target in obj:
                return f"has both {column!r} (the --{target}-column) and {target!r}"
            obj[target] = obj.pop(column)
        return None


ALL_NAMED = Columns()  # the columns are the field names


def expand(arguments: Sequence[str]) -> tuple[list[str], list[str]]:
    """Paths to read, in order (a glob's matches sorted, each path once), and the patterns matching none."""
    paths: list[str] = []
    missing: list[str] = []
    for argument in arguments:
        if argument != STDIN and glob.has_magic(argument):
            matches = sorted(glob.glob(argument))
            if not matches:
                missing.append(argument)
            paths += [m for m in matches if m not in paths]
        elif argument not in paths:
            paths.append(argument)
    return paths, missing


def read_source(path: str, columns: Columns = ALL_NAMED, stdin: bytes | None = None) -> Source:
    """Decode one input; never raises for what is in the file (problems are on the items or the source)."""
    if path == STDIN:
        source = Source("<stdin>", os.getcwd())
        data = stdin if stdin is not None else b""
    else:
        source = Source(path, os.path.dirname(os.path.abspath(path)))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            source.problem = f"cannot read request file: {exc.strerror or exc}"
            return source
    reader, source.unit = _READERS.get(os.path.splitext(path)[1].lower(), (jsonl_items, "line"))
    try:
        items = list(reader(data))
    except _Unreadable as exc:
        source.problem = str(exc)
        return source
    for item in items:
        if item.obj is not None and (problem := columns.rename(item.obj)):
            item = Item(item.number, None, problem)
        source.items.append(item)
    if not source.items:
        source.problem = "no requests in file"
    return source


class _Unreadable(ValueError):
    """The whole input cannot be decoded (not JSON, not Parquet)."""


def parse_object(text: str) -> tuple[JsonObject | None, str | None]:
    """One JSON text that must be an object: (object, None) or (None, problem)."""
    try:
        obj = json.loads(text, parse_constant=NonFinite, object_pairs_hook=_object_from_pairs)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} (column {exc.colno})"
    except ValueError:  # an integer literal past Python's int conversion limit (4300 digits)
        return None, "not valid JSON: a number has too many digits"
    except RecursionError:
        return None, "not valid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, f"each line must be a JSON object, got {describe(obj)}"
    return obj, None


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject(pairs)
    if len(obj) < len(pairs):
        keys = [key for key, _ in pairs]
        obj.duplicates = tuple(sorted({key for key in keys if keys.count(key) > 1}))
    return obj


ARRAY_HINT = "a JSON array? name the file .json, or write one object per line"
LINES_HINT = "one object per line is JSONL: name the file .jsonl"


def jsonl_items(data: bytes) -> Iterator[Item]:
    # Split on b"\n" only, so line numbers are the ones an editor and `wc -l` show; a "\r" left by CRLF
    # files is whitespace to the JSON parser.
    first = True  # the first line holding something: where a JSON array saved as .jsonl shows
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = f"0x{raw[exc.start]:02x}"
            yield Item(number, None, f"not valid UTF-8 (byte {bad} at offset {exc.start})")
            continue
        if number == 1:
            text = text.removeprefix("\ufeff")  # Windows editors start files with a byte-order mark
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        obj, problem = parse_object(text)
        if first and problem is not None and text.lstrip().startswith("["):
            problem = f"{problem} ({ARRAY_HINT})"
        first = False
        yield Item(number, obj, problem)


def _json_items(data: bytes) -> Iterator[Item]:
    try:
        doc = json.loads(
            data.decode("utf-8-sig"), parse_constant=NonFinite, object_pairs_hook=_object_from_pairs
        )
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not valid UTF-8 (byte offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        # JSONL saved as .json: the first object parses, the next line is "extra data".
        hint = f"; {LINES_HINT}" if exc.msg == "Extra data" and exc.doc.lstrip().startswith("{") else ""
        where = f"line {exc.lineno}, column {exc.colno}"
        raise _Unreadable(f"not valid JSON: {exc.msg} ({where}{hint})") from None
    except (ValueError, RecursionError):
        raise _Unreadable("not valid JSON: a number has too many digits or it is nested too deeply") from None
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise _Unreadable(f"a .json file holds an array of objects or one object, got {describe(doc)}")
    for number, obj in enumerate(doc, start=1):
        if isinstance(obj, dict):
            yield Item(number, obj)
        else:
            yield Item(number, None, f"must be a JSON object, got {describe(obj)}")


def _parquet_items(data: bytes) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise _Unreadable(f"not a readable Parquet file: {exc}") from None
    for number, row in enumerate(rows, start=1):
        yield _table_item(number, {key: value for key, value in row.items() if not _missing(value)})


def _csv_items(data: bytes) -> Iterator[Item]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not valid UTF-8 (byte offset {exc.start})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if None in row:  # more cells than the header has columns
                yield Item(reader.line_num, None, f"{len(row[None])} cell(s) more than the header's columns")
                continue
            cells = {key: value for key, value in row.items() if value not in (None, "")}
            yield _table_item(reader.line_num, cells)
    except csv.Error as exc:
        raise _Unreadable(f"not a readable CSV file (line {reader.line_num}): {exc}") from None


# File suffix -> (reader, what its numbers count); anything else (and standard input) is JSONL.
_READERS = {".json": (_json_items, "item"), ".parquet": (_parquet_items, "row"), ".csv": (_csv_items, "line")}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _table_item(number: int, cells: dict[str, Any]) -> Item:
    obj = JsonObject()
    for key, value in cells.items():
        converted, problem = _convert(key.strip(), value)
        if problem:
            return Item(number, None, f"column {key!r}: {problem}")
        obj[key.strip()] = converted
    return Item(number, obj)


def _convert(key: str, value: Any) -> tuple[Any, str | None]:
    """A table cell as its field's JSON value; text that is not one stays text for the field check to name."""
    if not isinstance(value, str):
        return value, None  # Parquet: already typed (structs are dicts, lists are lists)
    text = value.strip()
    if key in JSON_FIELDS:
        try:
            return json.loads(text, parse_constant=NonFinite, object_pairs_hook=_object_from_pairs), None
        except (ValueError, RecursionError) as exc:
            return None, f"not valid JSON: {exc}"
    if key in INT_FIELDS:
        try:
            return int(text), None
        except ValueError:
            return value, None
    if key in FLOAT_FIELDS:
        try:
            number = float(text)
        except ValueError:
            return value, None
        return (number if math.isfinite(number) else NonFinite(text)), None
    if key in BOOL_FIELDS:
        lowered = text.lower()
        return (True if lowered in _TRUE else False if lowered in _FALSE else value), None
    return value, None
