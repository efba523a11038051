"""HTML for one column: status, metrics, the token view (probability + top alternatives on hover), beams, samples,
and the column's branch tree.

Tokens of the main text carry what the click-to-branch script (web/branching.js) needs: `data-pos` (position in the
branch's full token list) and `data-alts` (the top alternatives as JSON [[id, text, p], ...]); the column carries
`data-mode`, `data-branch` and `data-seq`, a stamp larger on every drawing (web/draw.js keeps a column's newest
drawing when two handlers' frames reach the page out of order, and redraws only the parts, split at SEP, that
changed). A token's hover card is drawn by web/tips.js on hover from the token's facts: `data-alts` and `data-id`,
`data-lp` (log-prob), `data-h` (entropy), `data-k` (the probability a grammar masked) and `data-d` (a speculative
draft check, `_draft_data`); its kind of speculative token is its `m-` class. A token whose request asked for its
sampler pipeline carries it in `data-s` (web/pipeline.py), drawn by web/pipeline.js above the branch choices when
the token is clicked. Each token also carries its shadings, `--u` (1 - p), `--h` (entropy / ENTROPY_SCALE) and,
under a grammar, `--k` (the probability it masked): the "Shade tokens by" toggle only switches which one the
stylesheet uses, so it needs no re-render.
"""
from __future__ import annotations

import json
import math
import time
from html import escape

from shared.protocol import DraftCheck
from web.beam_tree import beam_tree_html
from web.branches import Branch, BranchTree
from web.columns import Column, Output, Token
from web.pipeline import stages_attr
from web.spec_curve import spec_curve_html

MODE_COLORS = {"greedy": "#2563eb", "beam": "#7c3aed", "sample": "#d97706", "speculative": "#059669"}
STATUS = {"idle": "ready", "waiting": "waiting for the shared prompt", "queued": "queued", "running": "streaming",
          "done": "done", "error": "error", "cancelled": "stopped", "invalid": "check the settings", "off": "off"}
SEP = "<!--s-->"  # between a column's parts (web/draw.js)
ENTROPY_SCALE = 5.0  # nats shaded at full strength (e^5 ~ 150 equally likely tokens)
_last_stamp = 0


def drawing_stamp() -> int:
    """Larger than every stamp before it: microseconds of the wall clock, so a restarted web server's drawings
    still count as newer on a page left open (and stay exact as JavaScript numbers)."""
    global _last_stamp
    _last_stamp = max(_last_stamp + 1, time.time_ns() // 1000)
    return _last_stamp


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:{fmt}}{unit}"


def _ms(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def token_prob(lp: float | None) -> float | None:
    """A token's probability from its log-prob (a saved run's file may hold any number: 1e9 drew OverflowError)."""
    return None if lp is None else math.exp(min(lp, 0.0))


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def _draft_data(d: DraftCheck) -> list:
    """A speculative token's draft check for its hover card (web/tips.js draws it): the draft token, its position
    in the round, accepted, p_draft q(x) (null for the n-gram proposer: q = 1), p_target p(x), min(1, p/q), and
    on a rejection the target's token id and text with the residual max(0, p - q)'s top [[id, text, prob], ...]."""
    return [d.draft_token, d.position, d.accepted, _round(d.p_draft, 4), _round(d.p_target, 4),
            _round(d.accept_prob, 4), d.residual_token_id, d.residual_token,
            [[tid, text, _round(prob, 4)] for tid, text, prob in d.residual_top]]


def _token(t: Token, pos: int | None = None, extra: str = "") -> str:
    p = token_prob(t.logprob)
    cls = f"tk m-{t.mark}" if t.mark else "tk"
    shade = [] if t.mark else [f"--u:{min(1.0, 1.0 - p):.2f}"] if p is not None else []
    if t.entropy is not None and not t.mark:
        shade.append(f"--h:{min(1.0, max(0.0, t.entropy) / ENTROPY_SCALE):.2f}")
    if t.masked is not None and not t.mark:
        shade.append(f"--k:{min(1.0, max(0.0, t.masked)):.2f}")
    attrs = f' style="{";".join(shade)}"' if shade else ""
    if pos is not None:  # clickable: branch from here
        attrs += f' data-pos="{pos}"'
    # the hover card's facts, drawn into a card by web/tips.js when the pointer first reaches the token. A
    # streamed column re-sends all its tokens every frame: the card's HTML per token was ~60% of a frame's bytes
    if t.top:
        alts = [[tid, text, _round(token_prob(lp), 4)] for tid, text, lp in t.top[:5]]
        attrs += f' data-alts="{escape(json.dumps(alts))}" data-id="{t.token_id}"'
    if t.logprob is not None:
        attrs += f' data-lp="{t.logprob:.4f}"'
    if t.entropy is not None:
        attrs += f' data-h="{t.entropy:.2f}"'
    if t.masked is not None:
        attrs += f' data-k="{t.masked:.4f}"'
    if t.draft is not None:
        attrs += f' data-d="{escape(json.dumps(_draft_data(t.draft)))}"'
    if t.stages:  # its sampler pipeline, drawn by web/pipeline.js in the click popup
        attrs += stages_attr(t.stages)
    body = escape(t.text).replace("\n", '<span class="nl">↵</span><br>')
    return f'<span class="{cls}{extra}"{attrs}>{body}</span>'


def tokens_html(out: Output) -> str:
    return "".join(_token(t) for t in out.tokens) or '<span class="dim">…</span>'


def main_tokens_html(tokens: list[Token], inherited: int = 0) -> str:
    """The main text, clickable; a branch's first `inherited` tokens (the parent's, then the picked one) marked."""
    return "".join(_token(t, i, " inh" if i < inherited - 1 else " fork" if i == inherited - 1 else "")
                   for i, t in enumerate(tokens)) or '<span class="dim">…</span>'


def tree_html(tree: BranchTree) -> str:
    """The column's branches (root first, children indented under their parent); click one to show it."""
    if len(tree.branches) < 2:
        return ""
    items = []
    for b in tree.ordered():
        on = " on" if b.id == tree.active else ""
        state = "" if b.column.status == "done" else f" <small>{escape(STATUS.get(b.column.status, ''))}</small>"
        arrow = "↳ " if b.parent is not None else ""
        title = "show this branch"
        if b.parent is not None and b.column.done is not None:  # the parent's blocks, via the prefix cache
            title += f" · {b.column.done.metrics.cached_prompt_tokens} prompt tokens from the prefix cache"
        items.append(f'<span class="tb{on}" data-branch="{b.id}" style="--d:{b.depth}" '
                     f'title="{escape(title)}">{arrow}{escape(b.label)}{state}</span>')
    return f'<div class="dl-tree"><span class="tl">branches</span>{"".join(items)}</div>'


def _metric(value: str, label: str, hint: str) -> str:
    return f'<div class="mt" title="{escape(hint)}"><b>{value}</b><span>{label}</span></div>'


def metrics_html(col: Column) -> str:
    finish = col.done.finish_reason if col.done else None
    return '<div class="mts">' + "".join([
        _metric(_ms(col.ttft), "TTFT", "time to first token: request created -> first token"),
        _metric(_num(col.tokens_per_s, ".1f"), "tok/s", "generated tokens / (request created -> last token)"),
        _metric(_ms(col.tpot), "TPOT", "time per output token after the first"),
        _metric(str(col.num_tokens) if col.outputs or col.done else "–", "tokens", "tokens generated"),
        _metric(escape(finish or "–"), "finish", "why generation stopped"),
    ]) + "</div>"


def _pill(col: Column) -> str:
    label = STATUS.get(col.status, col.status)
    if col.status == "queued":
        label = f"queued · #{col.queue_position} in line" if col.queue_position else "picked up · prefilling"
    title = ""
    if col.status == "done" and col.done and col.done.metrics.replica:
        label += f" · {col.done.metrics.replica}"
        if (h := col.done.metrics.handover):  # prefill/decode disaggregation: the prompt was computed elsewhere
            label = f"{STATUS.get(col.status, col.status)} · {h.get('from', '?')} → {col.done.metrics.replica}"
            title = (f"prefilled on {h.get('from', '?')}, decoded on {col.done.metrics.replica}: "
                     f"{h.get('blocks', 0)} KV blocks ({h.get('bytes', 0) / 1e6:.2f} MB) handed over in "
                     f"{h.get('transfer_ms', 0):.0f} ms through Redis; {h.get('imported_tokens', 0)} prompt tokens "
                     f"not computed again")
    return f'<span class="pill s-{col.status}" title="{escape(title)}">{escape(label)}</span>'


def _rate_s(col: Column, k: int) -> str:
    rate = col.acceptance_rate(k)
    return "–" if rate is None else f"{'' if rate[1] else '≈'}{rate[0] * 100:.0f}%"


def _speed_up(col: Column, greedy: Column | None) -> float | None:
    return greedy.tpot / col.tpot if greedy is not None and greedy.tpot and col.tpot else None


def _by_position_html(col: Column, k: int) -> str:
    """Acceptance by draft position, one bar per position of a step's draft: accepted / proposed there (a draft is
    kept only after every draft before it, so the bars fall from left to right)."""
    got = col.by_position(k)
    if got is None:
        return ""
    proposed, accepted, exact = got
    bars = []
    for i, (n, a) in enumerate(zip(proposed, accepted)):
        rate = a / n if n else None
        bars.append(f'<div class="bp" title="draft position {i + 1}: {a} accepted of {"" if exact else "≈"}{n}">'
                    f'<b>{_num(None if rate is None else rate * 100, ".0f", "%")}</b>'
                    f'<div class="well"><i style="height:{(rate or 0) * 100:.0f}%"></i></div>'
                    f'<span>{i + 1}</span></div>')
    cap = "acceptance by draft position" + ("" if exact else " (≈ while streaming)")
    return (f'<div class="bypos" data-exact="{str(exact).lower()}"><div class="cap">{cap}</div>'
            f'<div class="bars">{"".join(bars)}</div></div>')


def _proposer(col: Column) -> str:
    return col.request.params.proposer if col.request is not None else "?"


def _proposer_card(col: Column, greedy: Column | None, k: int) -> str:
    """One proposer's numbers, for the side-by-side comparison."""
    name = _proposer(col)
    err = f'<div class="err" role="alert">{escape(col.error)}</div>' if col.error else ""
    return (f'<div class="pcard" data-proposer="{escape(name)}"><div class="pn">{escape(name)} {_pill(col)}</div>'
            f'{err}<div class="mts">'
            f'{_metric(_rate_s(col, k), "acceptance", "draft tokens accepted / draft tokens proposed")}'
            f'{_metric(_num(col.tokens_per_step(), ".2f"), "tok/step", "tokens per target forward")}'
            f'{_metric(_ms(col.tpot), "TPOT", "time per output token after the first")}'
            f'{_metric(_num(_speed_up(col, greedy), ".2f", "×"), "vs greedy", "greedy TPOT / this TPOT")}'
            f'</div>{_by_position_html(col, k)}</div>')


def _curve_html(col: Column, k: int) -> str:
    """The column's acceptance on the speed-up curve (web/spec_curve.py), once it ended: while streaming, frames stay
    the size they were (the curve is 3-4 kB, and the estimate it would show is the ≈ one above)."""
    rate = col.acceptance_rate(k) if col.finished else None
    return spec_curve_html(rate[0], k, col.tokens_per_step(), rate[1]) if rate is not None else ""


def _spec_html(col: Column, greedy: Column | None, k: int, rival: Column | None = None) -> str:
    """The speculative numbers; with a `rival` (compare proposers: the same request with the other proposer),
    the two proposers side by side."""
    counts = col.spec_counts()
    if not counts and col.status != "done" and rival is None:
        return ""
    total = sum(counts.values()) or 1
    bar = "".join(f'<i class="m-{m}" style="flex:{counts.get(m, 0)}" title="{m}: {counts.get(m, 0)}"></i>'
                  for m in ("accepted", "bonus", "resampled", "target") if counts.get(m))
    if rival is not None:
        head = (f'<div class="proposers">{_proposer_card(col, greedy, k)}{_proposer_card(rival, greedy, k)}</div>'
                f'<div class="sect">marks below: {escape(_proposer(col))}</div>')
    else:
        drafted = _num(counts.get("accepted", 0) / total * 100, ".0f", "%")
        speed = _num(_speed_up(col, greedy), ".2f", "×")
        head = (f'<div class="mts">'
                f'{_metric(_rate_s(col, k), "acceptance", "draft tokens accepted / draft tokens proposed")}'
                f'{_metric(drafted, "from draft", "share of the output the proposer wrote")}'
                f'{_metric(speed, "vs greedy", "decode speed-up: greedy TPOT / speculative TPOT")}'
                f'</div>{_by_position_html(col, k)}')
    head += _curve_html(col, k)
    return (f'<div class="spec">{head}<div class="specbar">{bar}</div>'
            '<div class="legend"><span class="tk m-accepted">accepted</span> <span class="tk m-resampled">'
            'resampled</span> <span class="tk m-bonus">bonus</span> <span class="tk m-target">target only</span>'
            '</div></div>')


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _beams_html(col: Column) -> str:
    """Every beam after the best shows only where it leaves the best one: beams share their prefix (and its
    KV blocks)."""
    outs = sorted(col.outputs.values(), key=lambda o: o.index)
    if len(outs) < 2:
        return ""
    best = outs[0]
    rows = []
    for o in outs:
        if o is best:
            body = f'<span class="dim">the text above · {len(o.token_ids)} tokens</span>'
        else:
            same = _common_prefix(o.token_ids, best.token_ids)
            tail = o.tokens[same:] if len(o.tokens) == len(o.token_ids) else o.tokens
            if len(tail) == len(o.tokens):
                same = 0
            body = (f'<span class="same" title="identical to #1 up to here">…{same} tokens as #1…</span>' if same
                    else "") + ("".join(_token(t) for t in tail) or '<span class="dim">(a prefix of #1)</span>')
        rows.append(f'<div class="beam"><span class="rank">#{o.index + 1}</span>'
                    f'<span class="score" title="length-penalised score · cumulative logprob">'
                    f'{_num(o.score, ".3f")} <small>{_num(o.cumulative_logprob, ".1f")}</small></span>'
                    f'<div class="btext">{body}</div></div>')
    return '<div class="sect">Top beams <small>score · cumulative logprob</small></div>' + "".join(rows)


def _samples_html(col: Column) -> str:
    outs = sorted(col.outputs.values(), key=lambda o: o.index)
    return "".join(f'<div class="sect">sample {o.index + 1}</div><div class="txt">{tokens_html(o)}</div>'
                   for o in outs[1:])


def column_html(col: Column, greedy: Column | None = None, spec_k: int = 4, tree: BranchTree | None = None,
                rival: Column | None = None) -> str:
    """One column; with its `tree`, the tree's active branch (`col` is then ignored) and the tree itself;
    speculative with a `rival`, the two proposers side by side."""
    branch: Branch | None = tree.current if tree is not None else None
    if branch is not None:
        col = branch.column
    color = MODE_COLORS.get(col.mode, "#64748b")
    parts = [f'<div class="dl-col" style="--mode:{color}" data-mode="{col.mode}" data-status="{col.status}" '
             f'data-branch="{branch.id if branch else 0}" data-seq="{drawing_stamp()}">',
             f'<div class="hd">{_pill(col)}</div>', tree_html(tree) if tree is not None else "", metrics_html(col)]
    if col.mode == "speculative":
        parts.append(_spec_html(col, greedy, spec_k, rival))
    if col.error:
        parts.append(f'<div class="err" role="alert">{escape(col.error)}</div>')
    main = col.outputs.get(0)
    if main is not None or (branch is not None and branch.inherited):
        tokens = branch.tokens() if branch is not None else main.tokens
        parts.append(f'<div class="txt">{main_tokens_html(tokens, len(branch.inherited) if branch else 0)}</div>')
    elif col.status in ("queued", "waiting", "running"):
        parts.append('<div class="txt"><span class="dim">waiting for the first token…</span></div>')
    elif col.status == "idle":
        parts.append('<div class="txt"><span class="dim">Press Run.</span></div>')
    if col.mode == "beam":
        parts.append(beam_tree_html(col.beam_tree, color))
        parts.append(_beams_html(col))
    elif col.mode == "sample":
        parts.append(_samples_html(col))
    parts.append("</div>")
    # the opening tag, each part, the closing tag, split at SEP: web/draw.js redraws only the parts that changed
    return SEP.join(parts)


def message_html(text: str | None, kind: str = "error") -> str:
    return f'<div class="dl-msg {kind}" role="alert">{escape(text)}</div>' if text else ""
