"""The offload benchmark's output: the printed markdown table (some columns) and the CSV (every column)."""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = [
    "config", "runner", "world", "max_active", "und_cache", "outputs", "wall_s", "s_per_output",
    "time_vs_resident", "weight_MB_per_output", "stall_share", "peak_rss_MB", "peak_private_MB",
    "private_vs_resident", "peak_device_MB", "same_as_resident", "note",
]  # fmt: skip


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


TABLE = [  # (row key, column title) of the printed table; the CSV has every key
    ("config", "config"),
    ("world", "N"),
    ("max_active", "K"),
    ("und_cache", "UND cache"),
    ("s_per_output", "s/output"),
    ("time_vs_resident", "x resident"),
    ("weight_MB_per_output", "MB moved/output"),
    ("stall_share", "stall share"),
    ("peak_rss_MB", "peak RSS MB/rank"),
    ("peak_private_MB", "peak private MB/rank"),
    ("private_vs_resident", "x resident"),
    ("peak_device_MB", "peak device MB"),
    ("same_as_resident", "= resident"),
    ("note", "note"),
]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in TABLE) + " |", "|" + " --- |" * len(TABLE)]
    lines += ["| " + " | ".join(_fmt(row.get(key)) for key, _ in TABLE) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(v) if isinstance(v := row.get(k), float) else v for k in COLUMNS})
