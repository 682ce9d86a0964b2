"""`inferplane bench serve --plot FILE`: a self-contained SVG of a run's latencies, written by hand
(matplotlib is not among the project's dependencies, and one chart does not justify it).

Left: the cumulative distribution of TTFT (dashed) and end-to-end latency (solid) of every run, so a
sweep's runs lie side by side. Right, for a sweep: TTFT and E2E p50 and p99 of each run in order.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
PANEL_W, PANEL_H, MARGIN = 480, 340, 60


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1, 2 or 5 times a power of ten step that cuts `span` into about `ticks` parts."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


class _Panel:
    """One plot area: data coordinates to pixels, axes with ticks, lines."""

    def __init__(self, left: float, title: str, xlabel: str, ylabel: str, xmax: float, ymax: float,
                 xticks: list[tuple[float, str]] | None = None):
        self.left, self.top = left + MARGIN, 40
        self.w, self.h = PANEL_W - MARGIN - 20, PANEL_H - 100
        self.xmax, self.ymax = xmax or 1.0, ymax or 1.0
        self.parts = [f'<text x="{self.left + self.w / 2}" y="24" text-anchor="middle" font-weight="bold">'
                      f'{escape(title)}</text>',
                      f'<rect x="{self.left}" y="{self.top}" width="{self.w}" height="{self.h}" fill="none" '
                      'stroke="#444"/>',
                      f'<text x="{self.left + self.w / 2}" y="{self.top + self.h + 40}" text-anchor="middle">'
                      f'{escape(xlabel)}</text>',
                      f'<text transform="translate({self.left - 45},{self.top + self.h / 2}) rotate(-90)" '
                      f'text-anchor="middle">{escape(ylabel)}</text>']
        step = nice_step(self.xmax)
        for value, label in xticks or [(i * step, f"{i * step:g}") for i in range(int(self.xmax / step) + 1)]:
            x = self.x(value)
            self.parts.append(f'<line x1="{x:.1f}" y1="{self.top + self.h}" x2="{x:.1f}" y2="{self.top + self.h + 5}" '
                              'stroke="#444"/>')
            self.parts.append(f'<text x="{x:.1f}" y="{self.top + self.h + 18}" text-anchor="middle" '
                              f'font-size="11">{escape(label)}</text>')
        step = nice_step(self.ymax)
        for i in range(int(self.ymax / step) + 1):
            y = self.y(i * step)
            self.parts.append(f'<line x1="{self.left - 5}" y1="{y:.1f}" x2="{self.left + self.w}" y2="{y:.1f}" '
                              'stroke="#ddd"/>')
            self.parts.append(f'<text x="{self.left - 8}" y="{y + 4:.1f}" text-anchor="end" font-size="11">'
                              f'{i * step:g}</text>')

    def x(self, value: float) -> float:
        return self.left + self.w * value / self.xmax

    def y(self, value: float) -> float:
        return self.top + self.h * (1 - value / self.ymax)

    def line(self, points: list[tuple[float, float]], color: str, dashed: bool = False, marks: bool = False) -> None:
        if not points:
            return
        path = " ".join(f"{self.x(px):.1f},{self.y(py):.1f}" for px, py in points)
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        self.parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>')
        if marks:
            self.parts += [f'<circle cx="{self.x(px):.1f}" cy="{self.y(py):.1f}" r="3" fill="{color}"/>'
                           for px, py in points]

    def legend(self, entries: list[tuple[str, str, bool]], bottom_right: bool = False) -> None:
        """A boxed legend in the top-left corner, or the bottom-right one (where CDFs leave room)."""
        width = 46 + 6.5 * max(len(label) for label, _, _ in entries)
        height = 8 + 16 * len(entries)
        left = self.left + self.w - width - 6 if bottom_right else self.left + 6
        top = self.top + self.h - height - 6 if bottom_right else self.top + 6
        self.parts.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height}" fill="white" '
                          'fill-opacity="0.9" stroke="#bbb"/>')
        for i, (label, color, dashed) in enumerate(entries):
            y = top + 16 + 16 * i
            dash = ' stroke-dasharray="6 4"' if dashed else ""
            self.parts.append(f'<line x1="{left + 6:.1f}" y1="{y - 4}" x2="{left + 30:.1f}" y2="{y - 4}" '
                              f'stroke="{color}" stroke-width="1.8"{dash}/>')
            self.parts.append(f'<text x="{left + 36:.1f}" y="{y}" font-size="11">{escape(label)}</text>')


def _cdf(values: list[float]) -> list[tuple[float, float]]:
    ordered = sorted(values)
    return [(v, (i + 1) / len(ordered)) for i, v in enumerate(ordered)]


def svg(runs: list[dict]) -> str:
    """The SVG text for `runs` as `bench serve --json` holds them (each with label, requests, summary)."""
    done = [[r for r in run["requests"] if r["ok"]] for run in runs]
    ttfts = [[r["ttft"] * 1000 for r in d if r["ttft"] is not None] for d in done]
    e2es = [[r["e2e"] * 1000 for r in d] for d in done]
    xmax = max((max(v) for v in e2es + ttfts if v), default=1.0)
    cdf = _Panel(0, "Latency CDF (dashed: TTFT, solid: E2E)", "milliseconds", "fraction of requests", xmax, 1.0)
    for i in range(len(runs)):
        color = COLORS[i % len(COLORS)]
        cdf.line(_cdf(ttfts[i]), color, dashed=True)
        cdf.line(_cdf(e2es[i]), color)
    cdf.legend([(run["label"], COLORS[i % len(COLORS)], False) for i, run in enumerate(runs)], bottom_right=True)
    panels = [cdf]
    if len(runs) > 1:
        series = [("TTFT p50", "ttft_ms", "p50", COLORS[0], True), ("TTFT p99", "ttft_ms", "p99", COLORS[1], True),
                  ("E2E p50", "e2e_ms", "p50", COLORS[0], False), ("E2E p99", "e2e_ms", "p99", COLORS[1], False)]
        values = [[run["summary"][key][q] for run in runs] for _, key, q, _, _ in series]
        ymax = max((v for vs in values for v in vs if v is not None and math.isfinite(v)), default=1.0)
        ticks = [(i + 1, run["label"].replace(", concurrency ", " c=")) for i, run in enumerate(runs)]
        sweep = _Panel(PANEL_W, "Sweep: latency percentiles per run", "run", "milliseconds", len(runs) + 1, ymax,
                       xticks=ticks)
        for (_, _, _, color, dashed), vs in zip(series, values, strict=True):
            sweep.line([(i + 1, v) for i, v in enumerate(vs) if v is not None and math.isfinite(v)], color, dashed,
                       marks=True)
        sweep.legend([(label, color, dashed) for label, _, _, color, dashed in series])
        panels.append(sweep)
    width = PANEL_W * len(panels)
    body = "\n".join(part for panel in panels for part in panel.parts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{PANEL_H}" '
            f'viewBox="0 0 {width} {PANEL_H}" font-family="sans-serif" font-size="12">\n'
            f'<rect width="{width}" height="{PANEL_H}" fill="white"/>\n{body}\n</svg>\n')


def write_svg(path: str, runs: list[dict]) -> None:
    with open(path, "w") as handle:
        handle.write(svg(runs))
