"""The run report's figures as inline SVG: plain strings, no plotting library, nothing fetched.

Drawn from the per-rank pass timelines (`OUT/.cosmos3_batch/passes.*rank*.csv`) and summary.json. A
64-rank job has tens of thousands of passes per rank, so the timeline is binned to a fixed number of
columns per rank: the page stays small whatever the job's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

WIDTH = 960
ROW_H = 18
COLUMNS = 480  # timeline bins per rank


@dataclass(frozen=True)
class Pass:
    start_s: float
    duration_s: float
    und: bool
    active: int
    stall_s: float
    weight_bytes: int


def timeline(ranks: dict[str, list[Pass]], max_active: int) -> str:
    """One row per rank; each bin shaded by slot occupancy (active / --max-active), UND passes marked red
    above it, idle time left blank."""
    if not any(ranks.values()):
        return "<p>No pass timeline recorded.</p>"
    end = max(p.start_s + p.duration_s for passes in ranks.values() for p in passes) or 1.0
    label_w, top = 90, 20
    plot_w = WIDTH - label_w - 10
    height = top + ROW_H * len(ranks) + 24
    parts = [_svg_open(WIDTH, height, "Pass timeline per rank")]
    for row, (name, passes) in enumerate(ranks.items()):
        y = top + row * ROW_H
        parts.append(f'<text x="0" y="{y + 12}" class="lbl">{escape(name)}</text>')
        for column, (busy, occupancy, und) in _bins(passes, end, max_active).items():
            x = label_w + column * plot_w / COLUMNS
            w = plot_w / COLUMNS + 0.2
            shade = 0.25 + 0.75 * occupancy
            parts.append(
                f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.2f}" height="{(ROW_H - 6) * busy:.1f}" '
                f'fill="rgb(40,90,170)" fill-opacity="{shade:.2f}"/>'
            )
            if und:
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.2f}" height="3" fill="#c0392b"/>')
    axis_y = top + ROW_H * len(ranks) + 14
    parts.append(f'<text x="{label_w}" y="{axis_y}" class="lbl">0 s</text>')
    parts.append(f'<text x="{WIDTH - 10}" y="{axis_y}" class="lbl" text-anchor="end">{end:.1f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bins(passes: list[Pass], end: float, max_active: int) -> dict[int, tuple[float, float, bool]]:
    """column -> (busy fraction of the column, mean occupancy while busy, any UND pass)."""
    span = end / COLUMNS
    busy: dict[int, float] = {}
    occupied: dict[int, float] = {}
    und: dict[int, bool] = {}
    for p in passes:
        first = min(COLUMNS - 1, int(p.start_s / span))
        last = min(COLUMNS - 1, int((p.start_s + p.duration_s) / span))
        for column in range(first, last + 1):
            lo, hi = max(p.start_s, column * span), min(p.start_s + p.duration_s, (column + 1) * span)
            seconds = max(hi - lo, 0.0) if last > first else p.duration_s
            busy[column] = busy.get(column, 0.0) + seconds
            occupied[column] = occupied.get(column, 0.0) + seconds * p.active / max(max_active, 1)
            und[column] = und.get(column, False) or p.und
    return {
        c: (min(1.0, busy[c] / span), occupied[c] / busy[c] if busy[c] > 0 else 0.0, und[c]) for c in busy
    }


def bars(title: str, values: dict[str, float], unit: str, fmt: str = "{:.1%}") -> str:
    """A horizontal bar per rank (or any label), the value printed at its end."""
    if not values:
        return f"<p>No data for {escape(title)}.</p>"
    top, label_w = 20, 90
    height = top + ROW_H * len(values) + 6
    peak = max(values.values()) or 1.0
    plot_w = WIDTH - label_w - 140
    parts = [_svg_open(WIDTH, height, title)]
    for row, (name, value) in enumerate(values.items()):
        y = top + row * ROW_H
        w = plot_w * value / peak
        parts.append(f'<text x="0" y="{y + 12}" class="lbl">{escape(name)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 6}" fill="#2a7d4f"/>')
        text = f"{fmt.format(value)} {unit}".strip()
        parts.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 12}" class="lbl">{escape(text)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_open(width: int, height: int, title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img"><title>{escape(title)}</title>'
        f'<text x="0" y="12" class="ttl">{escape(title)}</text>'
    )
