"""The performance page's plots as small SVG files, written by hand (bench/table.py draws one per
result file): figures with their min-max range on a log axis around 1.0 (`ranges`), and curves
of a figure against a size (`curves`: the fleet's convergence time and gateway CPU per device).

No plotting library: the output is a pure function of the numbers (fixed rounding, no dates,
ids or fonts embedded), so `bench/table.py --check` can demand it byte for byte, and a plot is
1-4 KB where a plotting library's SVG, which embeds its glyphs, is ten times that."""
from __future__ import annotations

import math
from xml.sax.saxutils import escape

WIDTH = 640
ROW = 18          # px per figure in `ranges`
CHAR = 6.0        # px per character of the 11 px sans-serif text, for the labels' column
FONT = 'font-family="sans-serif" font-size="11"'
INK, RANGE, GRID = "#1f4e79", "#6a9bc3", "#d0d0d0"


def num(v: float) -> str:
    """A coordinate or value as the file holds it: one decimal, no trailing zeros (stable text)."""
    s = f"{v:.1f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def label(v: float) -> str:
    """A tick's or value's text: three significant figures at most."""
    return f"{v:.3g}"


def _svg(height: float, title: str, body: list[str]) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{num(height)}" '
            f'viewBox="0 0 {WIDTH} {num(height)}" {FONT}>')
    return "\n".join([head, f"<title>{escape(title)}</title>",
                      f'<rect width="{WIDTH}" height="{num(height)}" fill="#fff"/>',
                      f'<text x="8" y="16" font-weight="bold">{escape(title)}</text>', *body, "</svg>"]) + "\n"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 steps from the last one at or below `lo` to the first at or above `hi`; decades only
    when that spans more than three."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = [m * 10.0 ** e for e in range(a, b + 1) for m in (1, 2, 5)]
    first = max(t for t in steps if t <= lo * (1 + 1e-9))
    last = min(t for t in steps if t >= hi * (1 - 1e-9))
    if last / first <= 1.0001:
        last = next(t for t in steps + [10.0 ** (b + 1)] if t > first)
    if last / first > 1000:
        return [10.0 ** e for e in range(a, b + 1)]
    return [t for t in steps if first <= t <= last]


def ranges(title: str, rows: list[tuple[str, float, float, float]], ref: float = 1.0) -> str:
    """One line per (label, median, min, max): a dot at the median, a bar over the range, on a
    log axis that holds every range and `ref` (drawn dashed: the ratio that means "as fast")."""
    rows = [r for r in rows if min(r[1:]) > 0]
    if not rows:
        raise ValueError("nothing to plot: no positive figure")
    ticks = _log_ticks(min(min(r[1:]) for r in rows + [("", ref, ref, ref)]),
                       max(max(r[1:]) for r in rows + [("", ref, ref, ref)]))
    left = 16 + CHAR * max(len(r[0]) for r in rows)
    right = WIDTH - 70
    lo, hi = math.log10(ticks[0]), math.log10(ticks[-1])

    def x(v: float) -> float:
        return left + (right - left) * (math.log10(v) - lo) / (hi - lo)
    top, bottom = 28, 28 + ROW * len(rows) + 6
    body = []
    for t in ticks:
        body.append(f'<line x1="{num(x(t))}" y1="{top}" x2="{num(x(t))}" y2="{num(bottom)}" stroke="{GRID}"/>')
        body.append(f'<text x="{num(x(t))}" y="{num(bottom + 13)}" text-anchor="middle">{label(t)}</text>')
    body.append(f'<line x1="{num(x(ref))}" y1="{top}" x2="{num(x(ref))}" y2="{num(bottom)}" stroke="#888" '
                f'stroke-dasharray="4 3"/>')
    for i, (name, med, mn, mx) in enumerate(rows):
        y = top + ROW * i + ROW / 2 + 3
        body.append(f'<text x="{num(left - 8)}" y="{num(y + 4)}" text-anchor="end">{escape(name)}</text>')
        if mx > mn:
            body.append(f'<line x1="{num(x(mn))}" y1="{num(y)}" x2="{num(x(mx))}" y2="{num(y)}" '
                        f'stroke="{RANGE}" stroke-width="3"/>')
        body.append(f'<circle cx="{num(x(med))}" cy="{num(y)}" r="3.5" fill="{INK}"/>')
        body.append(f'<text x="{num(right + 6)}" y="{num(y + 4)}">{label(med)}</text>')
    return _svg(bottom + 20, title, body)


def _lin_ticks(hi: float) -> list[float]:
    """0 to a round value at or above `hi`, in 4 to 8 steps of 1, 2 or 5 times a power of ten."""
    if hi <= 0:
        return [0.0, 1.0]
    step = 10.0 ** math.floor(math.log10(hi / 4))
    for m in (1, 2, 5, 10):
        if hi / (m * step) <= 8:
            step *= m
            break
    n = math.ceil(hi / step - 1e-9)
    return [k * step for k in range(n + 1)]


def curves(title: str, x_name: str, panels: list[tuple[str, list[tuple[float, float, float, float]]]]) -> str:
    """Panels side by side, each a curve of (x, median, min, max) points against `x_name`, on
    linear axes from 0 (a straight line through the origin is linear growth)."""
    if not panels or not all(pts for _, pts in panels):
        raise ValueError("nothing to plot: a panel without points")
    gap, pw, ph, top = 56, (WIDTH - 56 * len(panels) - 20) / len(panels), 150, 40
    body = []
    for k, (name, pts) in enumerate(panels):
        pts = sorted(pts)
        x0 = gap + k * (pw + gap)
        xt, yt = _lin_ticks(max(p[0] for p in pts)), _lin_ticks(max(p[3] for p in pts))

        def px(v: float) -> float:
            return x0 + pw * v / xt[-1]

        def py(v: float) -> float:
            return top + ph - ph * v / yt[-1]
        body.append(f'<text x="{num(x0)}" y="{top - 8}">{escape(name)}</text>')
        for t in yt:
            body.append(f'<line x1="{num(x0)}" y1="{num(py(t))}" x2="{num(x0 + pw)}" y2="{num(py(t))}" stroke="{GRID}"/>')
            body.append(f'<text x="{num(x0 - 4)}" y="{num(py(t) + 4)}" text-anchor="end">{label(t)}</text>')
        for t in xt:
            body.append(f'<text x="{num(px(t))}" y="{num(top + ph + 14)}" text-anchor="middle">{label(t)}</text>')
        body.append(f'<text x="{num(x0 + pw / 2)}" y="{num(top + ph + 30)}" text-anchor="middle">{escape(x_name)}</text>')
        body.append(f'<polyline fill="none" stroke="{INK}" stroke-width="1.5" points="'
                    + " ".join(f"{num(px(p[0]))},{num(py(p[1]))}" for p in pts) + '"/>')
        for xv, med, mn, mx in pts:
            if mx > mn:
                body.append(f'<line x1="{num(px(xv))}" y1="{num(py(mn))}" x2="{num(px(xv))}" y2="{num(py(mx))}" '
                            f'stroke="{RANGE}" stroke-width="3"/>')
            body.append(f'<circle cx="{num(px(xv))}" cy="{num(py(med))}" r="3" fill="{INK}"/>')
    return _svg(top + ph + 40, title, body)
