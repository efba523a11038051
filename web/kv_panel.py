"""The KV-cache panel: block counters, prefix-cache hits, copy-on-write, and a map of who holds which block."""
from __future__ import annotations

from html import escape

from shared.monitor import KVSnapshot
from web.render import MODE_COLORS

OTHER = "#94a3b8"  # requests of other tabs / clients


def _tile(value: str, label: str, hint: str, cls: str = "") -> str:
    return f'<div class="kt {cls}" title="{escape(hint)}"><b>{value}</b><span>{label}</span></div>'


def _pct(a: float, b: float) -> str:
    return f"{a / b * 100:.0f}%" if b else "–"


def counters_html(s: KVSnapshot) -> str:
    st = s.stats
    g = lambda k: int(st.get(k, 0))  # noqa: E731
    total = g("blocks_total")
    return '<div class="kts">' + "".join([
        _tile(f"{g('blocks_used')}<small>/{total}</small>", "used", "blocks held by running sequences", "used"),
        _tile(str(g("blocks_shared")), "shared", "blocks held by more than one sequence (ref count > 1)", "shared"),
        _tile(str(g("blocks_cached")), "cached", "full blocks registered in the prefix cache (reusable by hash)",
              "cached"),
        _tile(str(g("blocks_free")), "free", "blocks with ref count 0 (cached ones are evicted last)", "free"),
        _tile(_pct(st.get("prefix_hits", 0), st.get("prefix_queries", 0)), "prefix hits",
              f"prompt tokens found in the prefix cache: {g('prefix_hits')} of {g('prefix_queries')}"),
        _tile(str(g("cow_copies")), "COW copies", "copy-on-write: a shared block copied before a sequence wrote "
                                                  "into it (beams, n > 1 samples)"),
        _tile(str(g("preemptions")), "preemptions", "sequences evicted from the batch for lack of blocks"),
        _tile(f"{g('num_running')}<small> run</small> · {g('num_waiting')}<small> wait</small>", "sequences",
              "sequences in the running batch / waiting inside the engine"),
    ]) + "</div>"


def _labels(s: KVSnapshot, owners: dict[str, str]) -> list[tuple[str, str]]:
    """(label, colour) per sequence: the column's mode, numbered when a request has several (beams, samples)."""
    per_request: dict[str, int] = {}
    for q in s.seqs:
        per_request[q.request_id] = per_request.get(q.request_id, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for q in s.seqs:
        mode = owners.get(q.request_id)
        name = mode or f"other {q.request_id[:6]}"
        seen[q.request_id] = seen.get(q.request_id, 0) + 1
        if per_request[q.request_id] > 1:
            name += f" {seen[q.request_id]}/{per_request[q.request_id]}"
        # a branch is labelled "greedy ⑂2": its column's colour
        out.append((name, MODE_COLORS.get(mode.split()[0], OTHER) if mode else OTHER))
    return out


def block_map_html(s: KVSnapshot, owners: dict[str, str]) -> str:
    holders: dict[int, list[tuple[str, str]]] = {}
    for q, label in zip(s.seqs, _labels(s, owners)):
        for b in q.blocks:
            if b < s.map_size:
                holders.setdefault(b, []).append(label)
    cached = set(s.cached)
    cells = []
    for b in range(s.map_size):
        hs = holders.get(b, [])
        flags = " · prefix-cached" if b in cached else ""
        if not hs:
            cls, style = ("c" if b in cached else "f"), ""
            title = f"block {b}: " + ("free, in the prefix cache (reusable)" if b in cached else "free")
        else:
            colors = sorted({c for _, c in hs})
            cls = "sh" if len(hs) > 1 else "u"
            style = f' style="--c:{colors[0]};--c2:{colors[-1]}"'
            title = f"block {b}: " + ", ".join(label for label, _ in hs) + (
                f" (shared ×{len(hs)})" if len(hs) > 1 else "") + flags
        cells.append(f'<i class="{cls}"{style} title="{escape(title)}"></i>')
    total = int(s.stats.get("blocks_total", s.map_size))
    more = f" of {total}" if total > s.map_size else ""
    return (f'<div class="bmap-cap">blocks 0–{s.map_size - 1}{more} · {s.block_size} tokens each · '
            f'replica {escape(s.replica)}</div><div class="bmap">{"".join(cells)}</div>')


def holders_html(s: KVSnapshot, owners: dict[str, str]) -> str:
    refs: dict[int, int] = {}
    for q in s.seqs:
        for b in q.blocks:
            refs[b] = refs.get(b, 0) + 1
    order = list(owners)
    rows = []
    for q, (label, color) in sorted(zip(s.seqs, _labels(s, owners)), key=lambda x: (
            x[0].request_id not in owners, order.index(x[0].request_id) if x[0].request_id in owners else 0)):
        shared = sum(1 for b in q.blocks if refs[b] > 1)
        hit = f" · prompt from cache: {q.cached_prompt_tokens} tok" if q.cached_prompt_tokens else ""
        rows.append(f'<div class="hold"><i style="background:{color}"></i><b>{escape(label)}</b> '
                    f'{len(q.blocks)} blocks ({shared} shared) · {q.tokens} tokens{hit}'
                    f'{" · waiting" if q.status == "waiting" else ""}</div>')
    return "".join(rows) or '<div class="dim">No sequence holds blocks right now.</div>'


LEGEND = ('<div class="bmap-legend"><span><i class="f"></i>free</span><span><i class="c"></i>free, prefix-cached</span>'
          + "".join(f'<span><i class="u" style="--c:{c}"></i>{m}</span>' for m, c in MODE_COLORS.items())
          + f'<span><i class="u" style="--c:{OTHER}"></i>other clients</span>'
          '<span><i class="sh" style="--c:#334155;--c2:#334155"></i>shared (ref &gt; 1)</span></div>')


def kv_panel_html(live: list[KVSnapshot], owners: dict[str, str] | None = None, peak: KVSnapshot | None = None,
                  running: bool = False) -> str:
    """`live`: the replicas' latest snapshots; `peak`: this run's busiest one, drawn once the run is over."""
    owners = owners or {}
    if not live and peak is None:
        return ('<div class="kv"><div class="dim">No KV snapshot in Redis yet: it appears once an engine replica '
                'is up (replicas publish one a few times per second while busy).</div></div>')
    parts = ['<div class="kv">']
    for s in live or [peak]:
        show = s
        caption = "live"
        if not running and peak is not None and peak.replica == s.replica:
            show, caption = peak, "at this run's busiest moment"
        model = f" · {escape(s.model)}" if s.model else ""
        parts.append(f'<div class="kv-rep"><div class="kv-title">Replica <b>{escape(s.replica)}</b>{model} · '
                     f'<small>counters: now</small></div>'
                     f'{counters_html(s)}<div class="kv-body"><div class="kv-map"><div class="sect">Block map '
                     f'<small>({caption})</small></div>{block_map_html(show, owners)}{LEGEND}</div>'
                     f'<div class="kv-hold"><div class="sect">Who holds what <small>({caption})</small></div>'
                     f'{holders_html(show, owners)}</div></div></div>')
    parts.append("</div>")
    return "".join(parts)
