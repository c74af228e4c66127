"""Line charts as standalone SVG (no plotting library in the venv): one chart, several series."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_W, _H = 720, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 160, 30, 40


def line_chart(
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    marks: Sequence[float] = (),
) -> str:
    """An SVG document: each series a polyline, ``marks`` as faint vertical lines (events)."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("nothing to plot")
    x_max = max(x for x, _ in points) or 1.0
    y_max = max(y for _, y in points) * 1.1 or 1.0
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + plot_w * x / x_max

    def sy(y: float) -> float:
        return _TOP + plot_h * (1 - y / y_max)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{_W / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
    ]
    out += [
        f'<line x1="{sx(m):.1f}" y1="{_TOP}" x2="{sx(m):.1f}" y2="{_TOP + plot_h}" stroke="#ddd"/>'
        for m in marks
        if 0 <= m <= x_max
    ]
    for i in range(5):
        y = y_max * i / 4
        out.append(
            f'<line x1="{_LEFT}" y1="{sy(y):.1f}" x2="{_LEFT + plot_w}" y2="{sy(y):.1f}" '
            'stroke="#eee"/>'
        )
        out.append(f'<text x="{_LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
        x = x_max * i / 4
        out.append(
            f'<text x="{sx(x):.1f}" y="{_TOP + plot_h + 16}" text-anchor="middle">{x:.4g}</text>'
        )
    out.append(
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="black"/>'
    )
    out.append(
        f'<text x="{_LEFT + plot_w / 2}" y="{_H - 6}" text-anchor="middle">{escape(x_label)}</text>'
    )
    out.append(
        f'<text x="14" y="{_TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {_TOP + plot_h / 2})">{escape(y_label)}</text>'
    )
    for i, (name, values) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        ly = _TOP + 14 * (i + 1)
        out.append(
            f'<line x1="{_W - _RIGHT + 10}" y1="{ly - 4}" x2="{_W - _RIGHT + 30}" y2="{ly - 4}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{_W - _RIGHT + 34}" y="{ly}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
