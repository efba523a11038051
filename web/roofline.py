"""The "Engine steps" panel: each engine step of the run on the replica's roofline, as inline SVG (no JS library).

A replica appends one StepRecord per engine step to Redis (shared/monitor.py) and puts its measured roofs on its
heartbeat (engine_service/engine/roofline.py). The chart is log-log: x the step's arithmetic intensity (modelled
FLOPs / modelled bytes), y its achieved FLOP/s (modelled FLOPs / the step's wall time). The memory roof is the slope
y = bandwidth x intensity, the compute roof the flat line, and they meet at the ridge. A step left of the ridge can at
best reach the slope (memory-bound), one right of it the flat roof (compute-bound). Dots are coloured by what the
step computed (prefill, decode, or both) and grow with the number of sequences in the batch; under the chart a strip
shows every step's tokens and time, oldest left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from shared.monitor import StepRecord

COLORS = {"prefill": "#e11d48", "decode": "#0284c7", "mixed": "#f59e0b"}
W, H = 560, 250  # the plot's viewBox
PAD_L, PAD_R, PAD_T, PAD_B = 54, 12, 14, 34
STRIP_H = 84
MAX_BARS = 300  # the strip shows the run's latest steps


def kind_of(s: StepRecord) -> str:
    if s.decode_tokens == 0:
        return "prefill"
    return "decode" if s.prefill_tokens == 0 else "mixed"


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _pct(f: float) -> str:
    return f"{f:.0%}" if f >= 0.1 else f"{f * 100:.2g}%"


def _achieved(s: StepRecord) -> float:
    return s.flops / s.seconds if s.seconds > 0 else 0.0


def _intensity(s: StepRecord) -> float:
    return s.flops / s.bytes if s.bytes else 0.0


@dataclass
class DecodeAt:
    """The decode steps of one batch size."""

    seqs: int
    intensity: float  # FLOP / byte, over all of them
    bound: str  # "memory" left of the ridge, "compute" right of it
    share: float  # of that roof: their bytes/s over the memory roof, or their FLOP/s over the compute roof


@dataclass
class Summary:
    """What a person reads above the chart: how close each kind of step came to the roof that bounds it."""

    prefill_compute: float | None  # prefill steps' FLOPs / their time / the compute roof
    decode: list[DecodeAt]  # at the fewest and at the most sequences decoding in a step (one entry if the same)
    ridge: float

    @classmethod
    def of(cls, steps: list[StepRecord], roofs: dict) -> Summary:
        peak, bw = roofs["flops_per_s"], roofs["bytes_per_s"]
        prefill = [s for s in steps if kind_of(s) == "prefill" and s.seconds > 0]
        decode = [s for s in steps if kind_of(s) == "decode" and s.seconds > 0 and s.bytes]
        pc = sum(s.flops for s in prefill) / sum(s.seconds for s in prefill) / peak if prefill else None
        at = []
        for n in sorted({min(s.num_seqs for s in decode), max(s.num_seqs for s in decode)} if decode else ()):
            group = [s for s in decode if s.num_seqs == n]
            flops, nbytes, t = (sum(getattr(s, f) for s in group) for f in ("flops", "bytes", "seconds"))
            memory = flops / nbytes < peak / bw
            at.append(DecodeAt(n, flops / nbytes, "memory" if memory else "compute",
                               nbytes / t / bw if memory else flops / t / peak))
        return cls(pc, at, peak / bw)

    def html(self) -> str:
        parts = []
        if self.prefill_compute is not None:
            parts.append(f'<span><i style="background:{COLORS["prefill"]}"></i><b>prefill</b>: '
                         f'{_pct(self.prefill_compute)} of the compute roof</span>')
        if self.decode:
            said = [f"{_pct(d.share)} of the {d.bound} roof at {d.seqs} sequence{'s' if d.seqs > 1 else ''} "
                    f"({d.intensity:.2g} FLOP/byte)" for d in self.decode]
            parts.append(f'<span><i style="background:{COLORS["decode"]}"></i><b>decode</b>: {" → ".join(said)}; '
                         f'the ridge is at {self.ridge:.2g}</span>')
        shares = [self.prefill_compute or 0.0] + [d.share for d in self.decode]
        if parts and max(shares) < 0.05:
            parts.append('<span class="dim">Far under both roofs: per-step overheads (scheduling, Python, kernel '
                         'launches), not the hardware, bound steps this small.</span>')
        return f'<div class="rl-sum">{"".join(parts)}</div>' if parts else ""


class _LogAxis:
    def __init__(self, lo: float, hi: float, start: float, end: float):
        self.lo, self.hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        self.hi = max(self.hi, self.lo + 1)
        self.start, self.end = start, end

    def __call__(self, v: float) -> float:
        f = (math.log10(max(v, 10.0 ** self.lo)) - self.lo) / (self.hi - self.lo)
        return self.start + f * (self.end - self.start)

    def decades(self) -> list[float]:
        return [10.0 ** e for e in range(self.lo, self.hi + 1)]


def _plot(steps: list[StepRecord], roofs: dict) -> str:
    peak, bw = roofs["flops_per_s"], roofs["bytes_per_s"]
    ridge = peak / bw
    pts = [(s, _intensity(s), _achieved(s)) for s in steps if s.bytes and s.seconds > 0 and s.flops]
    xs = [x for _, x, _ in pts] + [ridge]
    x = _LogAxis(min(xs) / 2, max(xs) * 2, PAD_L, W - PAD_R)
    x_lo = 10.0 ** x.lo
    ys = [y for _, _, y in pts] + [bw * x_lo]
    y = _LogAxis(min(ys) / 1.5, max(ys + [peak]) * 1.5, H - PAD_B, PAD_T)
    out = [f'<svg class="rl-plot" viewBox="0 0 {W} {H}" role="img" aria-label="roofline of the run\'s engine steps">']
    for d in x.decades():
        out.append(f'<line class="grid" x1="{x(d):.1f}" y1="{PAD_T}" x2="{x(d):.1f}" y2="{H - PAD_B}"/>'
                   f'<text class="tick" x="{x(d):.1f}" y="{H - PAD_B + 12}" text-anchor="middle">{d:g}</text>')
    for d in y.decades():
        out.append(f'<line class="grid" x1="{PAD_L}" y1="{y(d):.1f}" x2="{W - PAD_R}" y2="{y(d):.1f}"/>'
                   f'<text class="tick" x="{PAD_L - 4}" y="{y(d) + 3:.1f}" text-anchor="end">{_si(d, "")}</text>')
    out.append(f'<text class="axis" x="{(PAD_L + W - PAD_R) / 2}" y="{H - 4}" text-anchor="middle">arithmetic '
               f'intensity (FLOP / byte moved)</text><text class="axis" transform="rotate(-90)" x="{-(H - PAD_B) / 2}" '
               f'y="11" text-anchor="middle">achieved FLOP/s</text>')
    # the roofs: the slope from the left edge (or where it enters the plot) to the ridge, then flat
    x0 = max(x_lo, 10.0 ** y.lo / bw)
    unit = "op" if roofs.get("kind") == "int8" else "FLOP"
    (ax, ay), (bx, by) = (x(x0), y(bw * x0)), (x(ridge), y(peak))
    slope = math.degrees(math.atan2(by - ay, bx - ax))  # the memory roof's label runs along it
    lx, ly = ax + 0.12 * (bx - ax), ay + 0.12 * (by - ay) - 5
    out.append(f'<polyline class="roof" points="{ax:.1f},{ay:.1f} {bx:.1f},{by:.1f} {W - PAD_R},{by:.1f}"/>'
               f'<line class="ridge" x1="{x(ridge):.1f}" y1="{y(peak):.1f}" x2="{x(ridge):.1f}" y2="{H - PAD_B}"/>'
               f'<text class="roof-l" x="{W - PAD_R - 2}" y="{y(peak) - 4:.1f}" text-anchor="end">compute roof '
               f'{_si(peak, unit)}/s ({escape(str(roofs.get("kind", "")))})</text>'
               f'<text class="roof-l" transform="translate({lx:.1f},{ly:.1f}) rotate({slope:.1f})">memory roof '
               f'{_si(bw, "B")}/s</text>'
               f'<text class="ridge-l" x="{x(ridge) + 3:.1f}" y="{H - PAD_B - 4}">ridge {ridge:.2g}</text>')
    matmul = roofs.get("matmul_flops_per_s")
    if roofs.get("kind") == "int8" and matmul:  # the float matmuls of an int8 model (attention, fp16 layers)
        out.append(f'<line class="roof2" x1="{x(matmul / bw):.1f}" y1="{y(matmul):.1f}" x2="{W - PAD_R}" '
                   f'y2="{y(matmul):.1f}"/><text class="roof-l" x="{W - PAD_R - 2}" y="{y(matmul) + 11:.1f}" '
                   f'text-anchor="end">float matmul {_si(matmul, "FLOP")}/s</text>')
    for s, ix, fl in pts:
        k = kind_of(s)
        r = 2.5 + math.sqrt(s.num_seqs)
        tip = (f"step {s.step}: {k}, {s.prefill_tokens} prefill + {s.decode_tokens} decode tokens, {s.num_seqs} "
               f"sequences, {s.seconds * 1000:.1f} ms; {ix:.2g} FLOP/byte, {_si(fl, unit)}/s, "
               f"{_si(s.bytes / s.seconds, 'B')}/s")
        out.append(f'<circle class="pt {k}" cx="{x(ix):.1f}" cy="{y(fl):.1f}" r="{r:.1f}" fill="{COLORS[k]}">'
                   f'<title>{escape(tip)}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _strip(steps: list[StepRecord]) -> str:
    """Per step, oldest left: prefill and decode tokens stacked (height ~ sqrt of the tokens, so a one-token decode
    still shows beside a long prefill), and the step's time below."""
    shown = steps[-MAX_BARS:]
    n = len(shown)
    bw = (W - PAD_L - PAD_R) / max(n, 1)
    most = max(s.prefill_tokens + s.decode_tokens for s in shown) or 1
    slowest = max(s.seconds for s in shown) or 1.0
    top_h, time_h = 46, 26
    base = 4 + top_h
    out = [f'<svg class="rl-strip" viewBox="0 0 {W} {STRIP_H}" role="img" aria-label="tokens and time per step">'
           f'<text class="tick" x="{PAD_L - 4}" y="{base - top_h / 2}" text-anchor="end">tokens</text>'
           f'<text class="tick" x="{PAD_L - 4}" y="{base + 4 + time_h / 2}" text-anchor="end">time</text>']
    for i, s in enumerate(shown):
        total = s.prefill_tokens + s.decode_tokens
        h = top_h * math.sqrt(total / most)
        hp = h * s.prefill_tokens / total if total else 0.0
        x0 = PAD_L + i * bw
        w = max(bw - (1 if bw > 3 else 0), 0.6)
        tip = escape(f"step {s.step}: {s.prefill_tokens} prefill + {s.decode_tokens} decode tokens, "
                     f"{s.num_seqs} sequences, {s.seconds * 1000:.1f} ms")
        th = max(time_h * s.seconds / slowest, 0.5)
        out.append(f'<g><title>{tip}</title>'
                   f'<rect class="bar prefill" x="{x0:.1f}" y="{base - hp:.1f}" width="{w:.1f}" height="{hp:.1f}" '
                   f'fill="{COLORS["prefill"]}"/>'
                   f'<rect class="bar decode" x="{x0:.1f}" y="{base - h:.1f}" width="{w:.1f}" height="{h - hp:.1f}" '
                   f'fill="{COLORS["decode"]}"/>'
                   f'<rect class="bar time" x="{x0:.1f}" y="{base + 4:.1f}" width="{w:.1f}" height="{th:.1f}"/></g>')
    out.append(f'<text class="tick" x="{W - PAD_R}" y="{STRIP_H - 2}" text-anchor="end">{n} steps · slowest '
               f'{slowest * 1000:.1f} ms · most tokens {most}</text></svg>')
    return "".join(out)


LEGEND = ('<div class="rl-legend">' + "".join(f'<span><i style="background:{c}"></i>{k}</span>'
                                              for k, c in COLORS.items())
          + '<span class="dim">dot size: sequences in the batch · hover a dot or bar for the step</span></div>')


def roofline_html(steps: dict[str, list[StepRecord]], roofs: dict[str, dict], running: bool = False) -> str:
    """`steps`: per replica, the run's engine steps (oldest first); `roofs`: per replica, its heartbeat's roofs."""
    shown = {name: s for name, s in steps.items() if s}
    if not shown:
        wait = "Waiting for the engine's first step of this run…" if running else (
            "Run to see each engine step of the run against this machine's compute and memory roofs.")
        return f'<div class="rl"><div class="dim">{wait}</div></div>'
    parts = ['<div class="rl">']
    for name, recs in shown.items():
        r = roofs.get(name)
        head = (f'<div class="kv-title">Replica <b>{escape(name)}</b> · {len(recs)} steps of this run '
                '<small>(the whole batch: other clients\' requests included)</small></div>')
        if not r or not r.get("flops_per_s") or not r.get("bytes_per_s"):
            parts.append(f'<div class="rl-rep">{head}<div class="dim">This replica published no roofs (an older '
                         f'version): the steps are shown without them.</div>{_strip(recs)}</div>')
            continue
        parts.append(f'<div class="rl-rep">{head}{Summary.of(recs, r).html()}{_plot(recs, r)}{LEGEND}'
                     f'{_strip(recs)}</div>')
    parts.append("</div>")
    return "".join(parts)
