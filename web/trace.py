"""The probability trace: the four columns on one chart, as inline SVG (no JS library).

For each column, along the text it shows (output 0; the branch shown, if one is): a line of the chosen token's
probability p = exp(logprob) at each position, and a band of the entropy of the distribution it was drawn from
(the raw model's, in nats, as the token shading: full height at ENTROPY_SCALE nats, right axis). Greedy's line sits
on the top of each distribution; sampling dips where it drew an unlikely token; beam search trades a low token for a
likelier continuation; speculative at temperature 0 retraces greedy. Where a band is high and the line low, the model
was unsure; a high line over a low band is a token the model was sure of.

Each line carries `data-mode`, `data-n` (its points) and `data-p` (the probabilities, 4 decimals), so tests and
scripts read the values without decoding the drawing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from web.columns import Token
from web.render import ENTROPY_SCALE, MODE_COLORS, token_prob

W, H = 720, 200  # the plot's viewBox
PAD_L, PAD_R, PAD_T, PAD_B = 40, 44, 10, 30


@dataclass
class Trace:
    """One column's series: per position, the chosen token's probability and its distribution's entropy (None
    where the token carries none, e.g. a typed branch token)."""

    mode: str
    p: list[float | None]
    entropy: list[float | None]

    @classmethod
    def of(cls, mode: str, tokens: list[Token]) -> Trace:
        return cls(mode, [token_prob(t.logprob) for t in tokens], [t.entropy for t in tokens])

    def mean_p(self) -> float | None:
        known = [p for p in self.p if p is not None]
        return sum(known) / len(known) if known else None

    def mean_entropy(self) -> float | None:
        known = [h for h in self.entropy if h is not None]
        return sum(known) / len(known) if known else None


def _runs(values: list[float | None]) -> list[list[tuple[int, float]]]:
    """The stretches of consecutive known values, as (position, value) lists."""
    runs: list[list[tuple[int, float]]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((i, v))
    return [r for r in runs if r]


def trace_html(traces: list[Trace], running: bool = False) -> str:
    shown = [t for t in traces if any(p is not None for p in t.p)]
    if not shown:
        wait = "Waiting for the first tokens…" if running else (
            "Run to see each column's chosen-token probability along its text, with the entropy of each step.")
        return f'<div class="tr"><div class="dim">{wait}</div></div>'
    n = max(len(t.p) for t in shown)
    span = max(n - 1, 1)

    def x(i: int) -> float:
        return PAD_L + (i / span if n > 1 else 0.5) * (W - PAD_L - PAD_R)

    def y(f: float) -> float:  # f in [0, 1]: p, or entropy / ENTROPY_SCALE
        return H - PAD_B - min(1.0, max(0.0, f)) * (H - PAD_B - PAD_T)

    out = [f'<svg class="tr-plot" viewBox="0 0 {W} {H}" role="img" aria-label="probability trace of the four '
           f'columns">']
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line class="grid" x1="{PAD_L}" y1="{y(f):.1f}" x2="{W - PAD_R}" y2="{y(f):.1f}"/>'
                   f'<text class="tick" x="{PAD_L - 4}" y="{y(f) + 3:.1f}" text-anchor="end">{f:g}</text>'
                   f'<text class="tick" x="{W - PAD_R + 4}" y="{y(f) + 3:.1f}">{f * ENTROPY_SCALE:g}</text>')
    step = max(1, math.ceil(n / 10))
    for i in range(0, n, step):
        out.append(f'<text class="tick" x="{x(i):.1f}" y="{H - PAD_B + 12}" text-anchor="middle">{i + 1}</text>')
    out.append(f'<text class="axis" x="{(PAD_L + W - PAD_R) / 2}" y="{H - 4}" text-anchor="middle">token position'
               f'</text><text class="axis" transform="rotate(-90)" x="{-(H - PAD_B) / 2}" y="10" '
               f'text-anchor="middle">p(chosen token)</text><text class="axis" transform="rotate(90)" '
               f'x="{(H - PAD_B) / 2}" y="{-(W - 8)}" text-anchor="middle">entropy (nats)</text>')
    for t in shown:  # the bands first, under every line
        color = MODE_COLORS.get(t.mode, "#64748b")
        for run in _runs([None if h is None else h / ENTROPY_SCALE for h in t.entropy]):
            top = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in run)
            base = f"{x(run[-1][0]):.1f},{y(0):.1f} {x(run[0][0]):.1f},{y(0):.1f}"
            out.append(f'<polygon class="tr-h" data-mode="{t.mode}" points="{top} {base}" fill="{color}"/>')
    for t in shown:
        color = MODE_COLORS.get(t.mode, "#64748b")
        mean_p, mean_h = t.mean_p(), t.mean_entropy()
        tip = f"{t.mode}: {sum(p is not None for p in t.p)} tokens, mean p {mean_p:.2f}" + (
            f", mean entropy {mean_h:.2f} nats" if mean_h is not None else "")
        known = [(i, p) for i, p in enumerate(t.p) if p is not None]
        points = " ".join(f"{x(i):.1f},{y(p):.1f}" for i, p in known)
        values = ",".join(f"{p:.4f}" for _, p in known)
        dot = f'<circle cx="{x(known[0][0]):.1f}" cy="{y(known[0][1]):.1f}" r="2.5" fill="{color}"/>' if (
            len(known) == 1) else ""  # a one-point line draws nothing
        out.append(f'<g class="tr-line"><title>{escape(tip)}</title><polyline class="tr-p" data-mode="{t.mode}" '
                   f'data-n="{len(known)}" data-p="{values}" points="{points}" stroke="{color}"/>{dot}</g>')
    out.append("</svg>")
    legend = []
    for t in shown:
        mean_p, mean_h = t.mean_p(), t.mean_entropy()
        legend.append(f'<span data-mode="{t.mode}"><i style="background:{MODE_COLORS.get(t.mode, "#64748b")}"></i>'
                      f'<b>{t.mode}</b> mean p {mean_p:.2f}'
                      + (f" · H {mean_h:.2f}" if mean_h is not None else "") + "</span>")
    legend.append('<span class="dim">line: the chosen token\'s probability (left) · band: the entropy of its '
                  'distribution (right) · hover a line for its means</span>')
    return f'<div class="tr">{"".join(out)}<div class="rl-legend">{"".join(legend)}</div></div>'
