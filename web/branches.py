"""Branches of one column: the run's own request (the root) and the runs forked from any of its tokens.

Mechanism: a branch is a Column of its own (its own request and stream) plus the tokens it inherits: the
parent's visible tokens up to the fork point, then the token picked there (an alternative, or typed text).
Its request is the root's prompt with those tokens as a `Continuation`, so the engine's prefix cache hands it
the parent's KV blocks. Every branch keeps its tokens here, in the session: switching is instant, nothing runs.

Contract: pure data, no I/O. Positions count the branch's *full* token list (inherited + generated), which is
what the column shows and what a click reports; `fork` refuses positions and tokens it cannot continue from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import Continuation
from web.columns import Column, Token

MAX_BRANCHES = 12  # per column: a tree, not a forest


class BranchError(ValueError):
    pass


@dataclass
class Branch:
    id: int
    column: Column
    parent: int | None = None
    fork_at: int = 0  # the picked token's position in the branch's full token list
    inherited: list[Token] = field(default_factory=list)  # parent's tokens[:fork_at] + the picked token
    depth: int = 0

    @property
    def label(self) -> str:
        if self.parent is None:
            return "root"
        picked = self.inherited[-1].text.replace("\n", "↵") or "∅"
        return f"@{self.fork_at} ‘{picked}’"

    def tokens(self) -> list[Token]:
        """Everything the branch shows as output 0: inherited, then generated."""
        out = self.column.outputs.get(0)
        return self.inherited + (out.tokens if out is not None else [])


def continuation(tokens: list[Token]) -> Continuation:
    """The tokens as request parts: runs of known ids, and the text of typed tokens (no id)."""
    parts: list[list[int] | str] = []
    for t in tokens:
        if t.token_id is not None:
            if parts and isinstance(parts[-1], list):
                parts[-1].append(t.token_id)
            else:
                parts.append([t.token_id])
        elif t.text:
            parts.append(t.text)
    return Continuation(parts=parts)


@dataclass
class BranchTree:
    mode: str
    branches: list[Branch] = field(default_factory=list)
    active: int = 0
    rev: int = 0  # bumped on a new branch or a switch (a re-render key, with the active column's version)

    @classmethod
    def of(cls, root: Column) -> BranchTree:
        return cls(root.mode, [Branch(0, root)])

    @property
    def root(self) -> Branch:
        return self.branches[0]

    @property
    def current(self) -> Branch:
        return self.branches[self.active]

    @property
    def version(self) -> tuple[int, int, int]:
        return self.rev, self.active, self.current.column.version

    def get(self, branch_id: int) -> Branch:
        if not 0 <= branch_id < len(self.branches):
            raise BranchError(f"branch: no branch {branch_id} in the {self.mode} column")
        return self.branches[branch_id]

    def switch(self, branch_id: int) -> Branch:
        self.active = self.get(branch_id).id
        self.rev += 1
        return self.current

    def fork(self, parent_id: int, pos: int, picked: Token, column: Column) -> Branch:
        """A new branch (made active) continuing from `parent`'s tokens[:pos] + `picked`."""
        parent = self.get(parent_id)
        shown = parent.tokens()
        if not 0 <= pos <= len(shown):
            raise BranchError(f"position: {pos} is outside the branch's {len(shown)} tokens")
        if len(self.branches) >= MAX_BRANCHES:
            raise BranchError(f"branches: at most {MAX_BRANCHES} per column")
        if picked.token_id is None and not picked.text:
            raise BranchError("token: pick an alternative or type some text")
        prefix = shown[:pos]
        if any(t.token_id is None and not t.text for t in prefix):
            raise BranchError("position: the tokens before it are not known yet")
        branch = Branch(len(self.branches), column, parent.id, pos, [*prefix, picked], parent.depth + 1)
        self.branches.append(branch)
        self.active = branch.id
        self.rev += 1
        return branch

    def columns(self) -> list[Column]:
        return [b.column for b in self.branches]

    def ordered(self) -> list[Branch]:
        """Depth-first, children after their parent (in creation order): the order the tree is drawn in."""
        children: dict[int | None, list[Branch]] = {}
        for b in self.branches:
            children.setdefault(b.parent, []).append(b)
        out: list[Branch] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            b = stack.pop()
            out.append(b)
            stack.extend(reversed(children.get(b.id, [])))
        return out
