"""`cosmos3-batch report OUT`: OUT/report.html, a contact sheet of every output plus the run's figures.

Offline by construction: one self-contained HTML file per page (inline CSS and SVG, no script, nothing
fetched), thumbnails as files next to it. Built to stay usable at 100,000 outputs: pages of
`page_size` entries (OUT/report.html is the first, OUT/report/page-NNNN.html the rest), and each
thumbnail is made once and kept (OUT/report/thumbs/), remade only when its output is newer.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

from tqdm import tqdm

from cosmos3_batch.io import figures
from cosmos3_batch.io.catalog import Output, complete_outputs
from cosmos3_batch.io.metrics import STATE_DIR
from cosmos3_batch.io.outputs import atomic_write

PAGE_SIZE = 300
# summary.json, or summary.shard3of8.json with --shard: a request's own sidecar never matches (an id of
# "summary" is refused at validation, so no sidecar is ever named summary.json).
SUMMARY_NAME = re.compile(r"^summary(\.shard\d+of\d+)?\.json$")
THUMB_PX = 192  # longest side
REPORT_DIR = "report"


@dataclass
class Entry:
    id: str
    status: str  # ok | failed | interrupted
    kind: str = ""
    prompt: str = ""
    seed: str = ""
    steps: str = ""
    guidance: str = ""
    media: str = ""  # file name under OUT, for ok entries
    error: str = ""
    thumb: str = ""  # path relative to OUT
    output: Output | None = None  # where its media is: a file, or a member of a shard


def write_report(out: Path, page_size: int = PAGE_SIZE, progress: bool = True) -> Path:
    """Write the report pages; returns OUT/report.html. ValueError if OUT holds no run."""
    if page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {page_size}")
    summaries = sorted(p for p in out.glob("summary*.json") if SUMMARY_NAME.match(p.name))
    if not summaries and not (out / "metrics.csv").exists():
        raise ValueError(f"{out}: no summary.json or metrics.csv here (is it a run's --out folder?)")
    entries = collect(out, summaries)
    thumbs = out / REPORT_DIR / "thumbs"
    thumbs.mkdir(parents=True, exist_ok=True)
    for entry in tqdm(entries, desc="thumbnails", unit="output", disable=not progress):
        if entry.output is not None:
            entry.thumb = make_thumbnail(out, entry.output, thumbs)
    pages = [entries[i : i + page_size] for i in range(0, len(entries), page_size)] or [[]]
    figures_html = run_figures(out, summaries)
    for number, page in enumerate(pages, start=1):
        path = page_path(out, number)
        prefix = "" if number == 1 else "../"
        html = _page(
            out.name, number, len(pages), len(entries), page, prefix, figures_html if number == 1 else ""
        )
        atomic_write(path, lambda tmp, html=html: tmp.write_text(html, encoding="utf-8"))
    return page_path(out, 1)


def page_path(out: Path, number: int) -> Path:
    return out / "report.html" if number == 1 else out / REPORT_DIR / f"page-{number:04d}.html"


def collect(out: Path, summaries: list[Path]) -> list[Entry]:
    """Every request this folder has a record of: complete sidecars, and metrics rows of the others."""
    rows = _metrics_rows(out)
    entries: dict[str, Entry] = {}
    for rid, output in complete_outputs(out).items():
        request = output.record.get("request") or {}
        entries[rid] = Entry(
            id=rid,
            status="ok",
            kind=str(output.record.get("kind", "")),
            prompt=str(request.get("prompt", "")),
            seed=str(output.record.get("seed", "")),
            steps=str(request.get("num_inference_steps", "")),
            guidance=str(request.get("guidance_scale", "")),
            # A file under OUT (flat or nested), or the shard holding the sample (catalog.py checks both).
            media=output.path,
            output=output,
        )
    prompts = _prompts(summaries)
    for rid, row in rows.items():
        if rid in entries or row.get("status") == "ok":
            continue
        entries[rid] = Entry(
            id=rid,
            status=row.get("status") or "failed",
            kind=row.get("kind") or "",
            prompt=prompts.get(rid, ""),
            seed=row.get("seed") or "",
            steps=row.get("steps") or "",
            guidance=row.get("guidance") or "",
            error=row.get("error") or "",
        )
    return [entries[k] for k in sorted(entries)]


def _metrics_rows(out: Path) -> dict[str, dict]:
    path = out / "metrics.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {row["id"]: row for row in csv.DictReader(f)}


def _prompts(summaries: list[Path]) -> dict[str, str]:
    """Prompts of requests that left no sidecar, read back from the run's JSONL when it is still there."""
    from cosmos3_batch.requests.parse import RequestFileError, load_requests

    found: dict[str, str] = {}
    for path in summaries:
        sources = json.loads(path.read_text()).get("config", {}).get("prompts")
        sources = [sources] if isinstance(sources, str) else sources or []  # a list since samples/globs
        sources = [s for s in sources if s != "-" and Path(s).is_file()]
        if not sources:
            continue
        try:
            requests, _ = load_requests(sources, skip_invalid=True)
        except (RequestFileError, OSError):
            continue
        found.update({r.id: r.prompt for r in requests})
    return found


def make_thumbnail(out: Path, output: Output, thumbs: Path) -> str:
    """A JPEG of at most THUMB_PX a side: the image itself, or a video's first frame (its poster); a
    webdataset sample's media is read from its shard at its offset."""
    import io

    from PIL import Image

    media = Path(output.member or output.path)
    dest = thumbs / f"{output.id}.jpg"  # ids are safe in a URL; a member's key may hold "%2E"
    try:
        if dest.exists() and dest.stat().st_mtime >= output.finished:
            return str(dest.relative_to(out))
        data = output.read(out, media.suffix.lstrip("."))
        if media.suffix == ".mp4":
            import imageio.v3 as iio

            image = Image.fromarray(iio.imread(data, index=0, plugin="FFMPEG", extension=".mp4"))
        else:
            image = Image.open(io.BytesIO(data)).convert("RGB")
    except (OSError, ValueError, RuntimeError, KeyError):
        return ""  # unreadable output: the entry still links to it
    image.thumbnail((THUMB_PX, THUMB_PX))
    atomic_write(dest, lambda tmp: image.save(tmp, format="JPEG", quality=85))
    return str(dest.relative_to(out))


def run_figures(out: Path, summaries: list[Path]) -> str:
    sections = []
    for path in summaries:
        summary = json.loads(path.read_text())
        tag = path.stem.removeprefix("summary").lstrip(".")
        ranks = summary.get("ranks", [])
        max_active = int(summary.get("config", {}).get("max_active", 1))
        # The pass files, also when the summary has no rank reports (a rerun with nothing left to do).
        rank_ids = [r["rank"] for r in ranks] or _timeline_ranks(out, tag)
        timelines = {f"rank {k}": _passes(out, k, tag) for k in rank_ids}
        occupancy = {
            name: sum(p.active for p in passes) / (len(passes) * max_active)
            for name, passes in timelines.items()
            if passes
        }
        stall = {f"rank {r['rank']}": r["stall_s"] / r["pass_s"] for r in ranks if r.get("pass_s")}
        outputs = max(summary.get("generated_ok", 0), 1)
        moved = {
            f"rank {r['rank']}": (r.get("h2d_bytes", 0) + r.get("gathered_bytes", 0)) / 1e6 / outputs
            for r in ranks
        }
        title = escape(f"Run {tag} ({summary.get('started_at', '')})".replace("  ", " "))
        sections.append(
            f"<section><h2>{title}</h2>{_facts(summary)}"
            + figures.timeline(timelines, max_active)
            + figures.bars("Mean slot occupancy (active / --max-active)", occupancy, "")
            + figures.bars("Stall share (compute waiting for a layer part)", stall, "")
            + figures.bars("Weight bytes moved per output", moved, "MB", "{:,.1f}")
            + "</section>"
        )
    return "".join(sections)


def _timeline_ranks(out: Path, tag: str) -> list[int]:
    prefix = f"passes.{tag + '-' if tag else ''}rank"
    found = (
        p.name.removeprefix(prefix).removesuffix(".csv") for p in (out / STATE_DIR).glob(f"{prefix}*.csv")
    )
    return sorted(int(k) for k in found if k.isdigit())


def _passes(out: Path, rank: int, tag: str) -> list[figures.Pass]:
    path = out / STATE_DIR / f"passes.{tag + '-' if tag else ''}rank{rank}.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [
            figures.Pass(
                float(row["start_s"]),
                float(row["duration_s"]),
                row["und"] == "True",
                int(row["active"]),
                float(row["stall_s"]),
                int(row["weight_bytes"]),
            )
            for row in csv.DictReader(f)
        ]


def _facts(summary: dict) -> str:
    config = summary.get("config", {})
    facts = [
        ("generated", summary.get("generated_ok", 0)),
        ("failed", len(summary.get("failed", []))),
        ("already complete", summary.get("skipped_complete", 0)),
        ("wall", f"{summary.get('wall_s', 0)} s"),
        ("outputs / minute", summary.get("outputs_per_minute")),
        ("world", config.get("world_size")),
        ("offload", config.get("offload")),
        ("max active", config.get("max_active")),
    ]
    if stopped := summary.get("interrupted"):
        facts.append(("stopped by", stopped.get("signal")))
    cells = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts)
    return f'<dl class="facts">{cells}</dl>'


def _card(entry: Entry, prefix: str) -> str:
    def attr(text: str) -> str:
        return escape(text, quote=True)

    link = f"{prefix}{attr(entry.media)}" if entry.media else ""
    if entry.thumb:
        image = f'<img loading="lazy" src="{prefix}{attr(entry.thumb)}" alt="{attr(entry.id)}">'
        picture = f'<a href="{link}">{image}</a>'
    elif link:
        picture = f'<a class="nothumb" href="{link}">{escape(entry.media)}</a>'
    else:
        picture = f'<div class="nothumb">{escape(entry.status)}</div>'
    prompt = entry.prompt if len(entry.prompt) <= 160 else entry.prompt[:157] + "..."
    details = " · ".join(
        escape(part)
        for part in (entry.kind, f"seed {entry.seed}", f"{entry.steps} steps", f"cfg {entry.guidance}")
    )
    error = f'<p class="err">{escape(entry.error)}</p>' if entry.error else ""
    return (
        f'<figure class="card {attr(entry.status)}" id="{attr(entry.id)}">{picture}'
        f'<figcaption><b>{escape(entry.id)}</b><p title="{attr(entry.prompt)}">{escape(prompt)}</p>'
        f"<small>{details}</small>{error}</figcaption></figure>"
    )


def _pager(number: int, total: int) -> str:
    if total == 1:
        return ""

    def href(k: int) -> str:
        # Page 1 is OUT/report.html, the rest sit in OUT/report/.
        if number == 1:
            return "report.html" if k == 1 else f"{REPORT_DIR}/page-{k:04d}.html"
        return "../report.html" if k == 1 else f"page-{k:04d}.html"

    links = [
        f"<b>{k}</b>" if k == number else f'<a href="{href(k)}">{k}</a>'
        for k in range(1, total + 1)
        if k in (1, total) or abs(k - number) <= 3
    ]
    return f"<nav>page {number} of {total}: {' '.join(links)}</nav>"


def _page(
    title: str, number: int, pages: int, count: int, entries: list[Entry], prefix: str, head: str
) -> str:
    cards = "".join(_card(e, prefix) for e in entries)
    pager = _pager(number, pages)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}: cosmos3-batch report</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{CSS}</style></head>
<body><h1>{escape(title)}: {count} request(s)</h1>{head}{pager}
<main class="sheet">{cards}</main>{pager}</body></html>
"""


CSS = """
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px}h2{font-size:16px}
.facts{display:grid;grid-template-columns:repeat(8,auto);gap:2px 12px;margin:0 0 8px}
.facts dt{font-weight:600}.facts dd{margin:0}
svg{display:block;margin:8px 0;background:#fff}
svg .lbl{font:11px sans-serif}svg .ttl{font:bold 12px sans-serif}
nav{margin:12px 0}nav a,nav b{margin:0 4px}
.sheet{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:10px}
.card{margin:0;padding:8px;background:#fff;border:1px solid #ddd;border-radius:4px}
.card img{max-width:100%;height:auto;display:block;margin:auto}
.card.failed,.card.interrupted{border-color:#c0392b;background:#fdf0ee}
.card p{margin:4px 0;overflow-wrap:anywhere}.err{color:#a02010;font-size:12px}
.nothumb{display:block;height:100px;line-height:100px;text-align:center;background:#eee}
"""
