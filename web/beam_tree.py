"""The live beam tree of a beam-search column: the engine's BeamEvents (shared/protocol.py) folded into nodes, and
drawn as an SVG that grows to the right as the search steps.

Node 0 is the prompt. A "fork" node is a live beam after a step (child of the beam it grew from); a "finish" node
a hypothesis that ended. A node is alive while it is a live beam, a kept hypothesis, or leads to one: everything
else was pruned and fades. The path to the best hypothesis (or, while none has finished, the best live beam) is
drawn bold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from shared.protocol import BeamEvent

DX, DY, PAD = 30, 17, 10  # px per step, per slot, around the drawing


@dataclass
class Node:
    id: int
    step: int = -1  # -1: the prompt (root); s: added by search step s, so it ends with generated token s + 1
    parent: int | None = None
    kind: str = "root"  # root | fork | finish
    token: str = ""
    logprob: float | None = None
    score: float | None = None
    rank: int | None = None
    blocks: list[int] | None = None
    pruned: bool = False
    children: list[int] = field(default_factory=list)


@dataclass
class BeamTree:
    nodes: dict[int, Node] = field(default_factory=lambda: {0: Node(0)})
    steps: int = 0  # search steps seen

    def feed(self, events: list[BeamEvent]) -> None:
        for e in events:
            if e.kind == "prune":
                if e.node in self.nodes:
                    self.nodes[e.node].pruned = True
                continue
            parent = self.nodes.get(e.parent if e.parent is not None else 0)
            if parent is None or e.node in self.nodes:
                continue  # an event of a stream we joined late: draw what we can
            self.nodes[e.node] = Node(e.node, e.step, parent.id, e.kind, e.token or "", e.logprob, e.score, e.rank,
                                      e.blocks)
            parent.children.append(e.node)
            self.steps = max(self.steps, e.step + 1)

    def __len__(self) -> int:
        return len(self.nodes) - 1

    def alive(self) -> set[int]:
        """Nodes that are a live beam, a kept hypothesis, or an ancestor of one."""
        out: set[int] = set()
        for n in self.nodes.values():
            leaf_alive = (n.kind == "fork" and not n.children and not n.pruned) or (n.kind == "finish" and not n.pruned)
            while leaf_alive and n is not None and n.id not in out:
                out.add(n.id)
                n = self.nodes.get(n.parent) if n.parent is not None else None
        return out

    def best(self) -> Node | None:
        """The best kept hypothesis, else the best live beam of the last step."""
        done = [n for n in self.nodes.values() if n.kind == "finish" and not n.pruned and n.score is not None]
        if done:
            return max(done, key=lambda n: n.score)
        live = [n for n in self.nodes.values() if n.kind == "fork" and not n.children and not n.pruned]
        return min(live, key=lambda n: (-n.step, n.rank if n.rank is not None else 0)) if live else None

    def path(self, node: Node | None) -> set[int]:
        out = set()
        while node is not None:
            out.add(node.id)
            node = self.nodes.get(node.parent) if node.parent is not None else None
        return out

    def layout(self) -> dict[int, tuple[int, int]]:
        """(column, row) per node: a step's nodes ordered under their parents' rows, best first among siblings."""
        pos = {0: (0, 0)}
        by_step: dict[int, list[Node]] = {}
        for n in self.nodes.values():
            if n.id:
                by_step.setdefault(n.step, []).append(n)
        for step in sorted(by_step):
            ordered = sorted(by_step[step], key=lambda n: (pos.get(n.parent, (0, 1 << 20))[1], n.kind != "fork",
                                                            -(n.score if n.score is not None else -1e30)))
            for row, n in enumerate(ordered):
                pos[n.id] = (step + 1, row)
        return pos

    def sharing(self) -> tuple[int, int, int, int] | None:
        """(step, live beams, their block-table entries, distinct blocks) at the last step that kept beams."""
        forks = [n for n in self.nodes.values() if n.kind == "fork" and n.blocks]
        if not forks:
            return None
        step = max(n.step for n in forks)
        last = [n for n in forks if n.step == step]
        return step, len(last), sum(len(n.blocks) for n in last), len({b for n in last for b in n.blocks})


def _visible(text: str) -> str:
    return text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·") or "∅"


def _title(n: Node) -> str:
    """A node's hover text; only nodes still alive get one (the pruned are drawn as one path)."""
    if n.kind == "root":
        return "the prompt"
    what = {"fork": "live beam", "finish": "finished hypothesis"}[n.kind]
    lines = [f"{_visible(n.token)} · {what} after token {n.step + 1}"]
    if n.logprob is not None:
        lines.append(f"logprob {n.logprob:.3f}")
    if n.score is not None:
        lines.append(("score (length-penalised) " if n.kind == "finish" else "summed logprob ") + f"{n.score:.3f}")
    if n.rank is not None:
        lines.append(f"rank #{n.rank + 1}")
    if n.blocks:
        lines.append(f"KV blocks {n.blocks}")
    return escape("\n".join(lines))


def beam_tree_html(tree: BeamTree, color: str = "#7c3aed", max_label: int = 5) -> str:
    if len(tree) == 0:
        return ""
    pos, alive, best = tree.layout(), tree.alive(), tree.best()
    bold = tree.path(best)
    cols = 1 + max(c for c, _ in pos.values())
    rows = 1 + max(r for _, r in pos.values())
    width, height = PAD * 2 + cols * DX, PAD * 2 + rows * DY

    def xy(nid: int) -> tuple[float, float]:
        c, r = pos[nid]
        return PAD + c * DX + 4, PAD + r * DY + 4

    # one <path> per edge state and one for every pruned node: a column re-renders its tree every frame, and the
    # browser's cost grows with elements; the nodes still alive keep an element each, with a hover title
    edges: dict[str, list[str]] = {"on": [], "live": [], "dead": []}
    dead, dots = [], []
    for n in tree.nodes.values():
        x, y = xy(n.id)
        state = "on" if n.id in bold else "live" if n.id in alive else "dead"
        if n.parent is not None:
            px, py = xy(n.parent)
            edges[state].append(f"M{px:.0f},{py:.0f}C{px + DX / 2:.0f},{py:.0f} {x - DX / 2:.0f},{y:.0f} "
                                f"{x:.0f},{y:.0f}")
        if state == "dead":
            dead.append(f"M{x - 3:.0f},{y:.0f}a3,3 0 1,0 6,0a3,3 0 1,0 -6,0")
            continue
        shape = (f'<rect x="{x - 4:.0f}" y="{y - 4:.0f}" width="8" height="8"/>' if n.kind == "finish"
                 else f'<circle cx="{x:.0f}" cy="{y:.0f}" r="{4 if n.kind == "root" else 3.2}"/>')
        label = ""
        if n.kind != "root":
            label = f'<text x="{x + 5:.0f}" y="{y - 4:.0f}">{escape(_visible(n.token)[:max_label])}</text>'
        dots.append(f'<g class="bn {n.kind} {state}" data-node="{n.id}"><title>{_title(n)}</title>'
                    f'{shape}{label}</g>')
    paths = "".join(f'<path class="be {state}" d="{"".join(d)}"/>' for state, d in edges.items() if d)
    if dead:
        paths += f'<path class="bd" d="{"".join(dead)}"><title>pruned: no longer leads to a live beam or a kept ' \
                 f'hypothesis</title></path>'
    svg = (f'<svg class="bt" width="{width}" height="{height}" viewBox="0 0 {width} {height}" style="--mode:{color}" '
           f'role="img" aria-label="beam search tree">{paths}{"".join(dots)}</svg>')
    counts = {"fork": 0, "finish": 0, "pruned": 0}
    for n in tree.nodes.values():
        if n.kind != "root":
            counts["pruned" if n.pruned or n.id not in alive else n.kind] += 1
    caption = [f"{tree.steps} steps", f"{counts['finish']} finished", f"{counts['pruned']} pruned"]
    shared = tree.sharing()
    if shared is not None and shared[1] > 1:
        step, beams, entries, distinct = shared
        caption.append(f"after token {step + 1}, {beams} live beams hold {entries} block-table entries in "
                       f"{distinct} distinct KV blocks")
    return (f'<div class="sect">Beam tree <small>{" · ".join(caption)}</small></div>'
            f'<div class="bt-scroll">{svg}</div>')
