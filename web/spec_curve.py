"""The speed-up curve of speculative decoding, with the run's measured acceptance placed on it (inline SVG).

With k drafts per step, each accepted independently with probability alpha, a verification step yields
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (Leviathan et al. 2023): the accepted prefix plus the one token
the target always adds. The curve is flat near 1 for low acceptance and climbs to k + 1 only as alpha nears 1,
which is why a proposer that rarely guesses right (n-gram on fresh prose) buys nothing, and one that copies text
the model is repeating buys several tokens per forward. The dot is the run's acceptance on the run's k curve; the
ring is what the run measured (tokens per target forward), which falls below the dot when acceptance is not
independent from draft to draft (a wrong draft ends the step) or steps draft fewer than k (the last ones, or all
after rejections with "Adaptive k", SamplingParams.speculative_schedule).
"""
from __future__ import annotations

from html import escape

W, H = 300, 150  # the plot's viewBox
PAD_L, PAD_R, PAD_T, PAD_B = 30, 36, 8, 26
OTHER_K = (1, 2, 4, 8)  # faint curves beside the run's own k, for scale
POINTS = 25  # per curve: smooth at this size, and the column is re-sent on every frame of a run
COLOR = "#059669"  # the speculative column's (web/render.py MODE_COLORS)
# presentation attributes, not stylesheet rules: the drawing carries its own look
STYLE = {"sc-c": f'fill="none" stroke="{COLOR}" stroke-width="2"',
         "sc-o": 'fill="none" stroke="currentColor" stroke-opacity=".25" stroke-width="1"',
         "sc-ax": 'stroke="currentColor" stroke-opacity=".4"',
         "sc-dot": f'fill="{COLOR}"', "sc-m": f'fill="none" stroke="{COLOR}" stroke-width="1.5"'}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verification step with k drafts at acceptance alpha (alpha in [0, 1])."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _x(alpha: float) -> float:
    return PAD_L + alpha * (W - PAD_L - PAD_R)


def _y(tokens: float, top: float) -> float:
    return H - PAD_B - (tokens - 1.0) / (top - 1.0) * (H - PAD_T - PAD_B)


def _curve(k: int, top: float, cls: str) -> str:
    pts = " ".join(f"{_x(a / POINTS):.1f},{_y(expected_tokens(a / POINTS, k), top):.1f}" for a in range(POINTS + 1))
    label = f'<text class="sc-k" x="{_x(1.0) + 3:.1f}" y="{_y(k + 1.0, top) + 3:.1f}">k={k}</text>'
    return f'<polyline class="{cls}" data-k="{k}" points="{pts}" {STYLE[cls]}/>{label}'


def _axes(top: float) -> str:
    ticks = "".join(f'<text x="{_x(a):.1f}" y="{H - PAD_B + 12}" text-anchor="middle">{a:.0%}</text>'
                    for a in (0.0, 0.25, 0.5, 0.75, 1.0))
    yticks = "".join(f'<text x="{PAD_L - 4}" y="{_y(t, top) + 3:.1f}" text-anchor="end">{t:g}</text>'
                     for t in range(1, int(top) + 1))
    return (f'<line class="sc-ax" x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" {STYLE["sc-ax"]}/>'
            f'<line class="sc-ax" x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" {STYLE["sc-ax"]}/>'
            f'{ticks}{yticks}'
            f'<text x="{(PAD_L + W - PAD_R) / 2:.0f}" y="{H - 2}" text-anchor="middle">acceptance α</text>')


def spec_curve_html(alpha: float | None, k: int, measured: float | None = None, exact: bool = True) -> str:
    """The curves, the run's k in bold, the run's point on it; "" before the acceptance is known."""
    if alpha is None or k < 1:
        return ""
    alpha = min(max(alpha, 0.0), 1.0)
    top = float(max(k, max(OTHER_K)) + 1)
    curves = "".join(_curve(j, top, "sc-o") for j in OTHER_K if j != k) + _curve(k, top, "sc-c")
    expected = expected_tokens(alpha, k)
    ring = "" if measured is None else (
        f'<circle class="sc-m" cx="{_x(alpha):.1f}" cy="{_y(min(measured, top), top):.1f}" r="5" {STYLE["sc-m"]}>'
        f"<title>measured: {measured:.2f} tokens per target forward</title></circle>")
    dot = (f'<circle class="sc-dot" cx="{_x(alpha):.1f}" cy="{_y(expected, top):.1f}" r="4" {STYLE["sc-dot"]}>'
           f"<title>α = {alpha:.0%}, k = {k}: {expected:.2f} tokens per step expected</title></circle>")
    approx = "" if exact else "≈"
    got = "" if measured is None else f", measured {measured:.2f}"
    caption = (f"acceptance {approx}{alpha:.0%} with k={k}: {expected:.2f} tokens per step expected{got}. "
               "Speculation pays where acceptance is high: text the model repeats from its context (n-gram) or "
               "a draft model that agrees with it.")
    data = f'data-alpha="{alpha:.4f}" data-k="{k}" data-expected="{expected:.4f}"'
    if measured is not None:
        data += f' data-measured="{measured:.4f}"'
    svg = (f'<svg class="sc-plot" viewBox="0 0 {W} {H}" role="img" aria-label="speed-up curve" font-size="9" '
           f'fill="currentColor" style="width:100%;max-width:360px">{_axes(top)}{curves}{ring}{dot}</svg>')
    return (f'<div class="spec-curve" {data}><div class="cap">tokens per step: (1 − α<sup>k+1</sup>) / (1 − α)</div>'
            f'{svg}<div class="sc-note">{escape(caption)}</div></div>')
