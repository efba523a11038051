"""The summary after a run: tokens/s and time to first token per mode (matplotlib, no pyplot state)."""
from __future__ import annotations

from matplotlib.figure import Figure

from web.columns import Column
from web.modes import TITLES
from web.render import MODE_COLORS


def summary_figure(columns: list[Column]) -> Figure | None:
    done = [c for c in columns if c.status == "done" and c.num_tokens]
    if not done:
        return None
    fig = Figure(figsize=(7.0, 2.6), dpi=110, layout="constrained")
    ax_speed, ax_ttft = fig.subplots(1, 2)
    names = [TITLES[c.mode] for c in done][::-1]
    colors = [MODE_COLORS[c.mode] for c in done][::-1]
    panels = ((ax_speed, [c.tokens_per_s or 0.0 for c in done][::-1], "tokens / s (higher is better)", "{:.1f}"),
              (ax_ttft, [(c.ttft or 0.0) * 1000 for c in done][::-1], "time to first token, ms (lower is better)",
               "{:.0f}"))
    for ax, values, title, fmt in panels:
        bars = ax.barh(names, values, color=colors, height=0.62)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=3, fontsize=8, color="#334155")
        ax.set_title(title, fontsize=9, color="#334155", loc="left")
        ax.set_xlim(0, max(values + [1e-9]) * 1.25)
        ax.tick_params(labelsize=8, colors="#475569")
        ax.xaxis.set_visible(False)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        ax.spines["left"].set_color("#cbd5e1")
    return fig
