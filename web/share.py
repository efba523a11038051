"""Shareable runs: a finished Run as one versioned JSON document, kept in Redis for a link or handed over as a file.

Mechanism: `SavedRun` mirrors what the playground draws (settings, every column and branch with its tokens,
probabilities, alternatives and draft checks, the beam tree, the KV snapshots and the engine steps). `saved_run`
takes it from a Run, `restore` builds a Run from it that the same renderers draw, read-only. In Redis it lives
at `<prefix>:run:<id>` (zlib, base64: the web's connections decode text) with a TTL, so any web replica of the
deployment opens `?run=<id>`, and nothing of it depends on the engine replica that ran it.

Contract: what goes in comes out equal (JSON keeps Python floats exactly); a document that is not a run of this
version, or over the size caps, is refused with a ShareError whose text says why (never a crash).
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import time
import zlib
from dataclasses import asdict
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from shared.keys import Keys
from shared.monitor import KVSnapshot, StepRecord
from shared.protocol import DoneEvent, DraftCheck, GenerationRequest, SamplerStage
from web.beam_tree import BeamTree, Node
from web.branches import Branch, BranchTree
from web.columns import Column, Output, Token
from web.modes import MODES, Settings

VERSION = 1
KIND = "decodelab-run"
MAX_STORED_BYTES = 1 << 20  # one saved run in Redis, compressed: a run of every mode at max tokens fits with room
MAX_FILE_BYTES = 8 << 20  # an uploaded file (and a run's JSON before compression)
TTL_S = int(os.environ.get("DECODELAB_SHARED_RUN_TTL_S", 7 * 86400))  # a link lives a week, by default
ID_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")


class ShareError(ValueError):
    """What the visitor sees: a saved run cannot be written, found or read."""


class _Saved(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SavedToken(_Saved):
    text: str
    token_id: int | None = None
    logprob: float | None = None
    top: list[tuple[int, str, float | None]] = []
    mark: str | None = None
    entropy: float | None = None
    masked: float | None = None
    draft: DraftCheck | None = None
    stages: list[SamplerStage] | None = None  # the sampler pipeline, where the run asked for it

    @classmethod
    def of(cls, t: Token) -> SavedToken:
        return cls(text=t.text, token_id=t.token_id, logprob=t.logprob, top=list(t.top), mark=t.mark,
                   entropy=t.entropy, masked=t.masked, draft=t.draft, stages=t.stages)

    def token(self) -> Token:
        return Token(self.text, self.token_id, self.logprob, [tuple(a) for a in self.top], self.mark, self.entropy,
                     self.masked, self.draft, self.stages)


class SavedOutput(_Saved):
    index: int
    tokens: list[SavedToken] = []
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    score: float | None = None


class SavedNode(_Saved):
    id: int
    step: int = -1
    parent: int | None = None
    kind: Literal["root", "fork", "finish"] = "root"  # (beam_tree.Node's: the page draws these three)
    token: str = ""
    logprob: float | None = None
    score: float | None = None
    rank: int | None = None
    blocks: list[int] | None = None
    pruned: bool = False
    children: list[int] = []


class SavedColumn(_Saved):
    mode: Literal[MODES]  # type: ignore[valid-type]
    status: str
    request: GenerationRequest | None = None
    error: str | None = None
    error_code: str | None = None
    outputs: list[SavedOutput] = []
    submitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: DoneEvent | None = None
    attempt: int = 0
    restarts: int = 0
    beam_nodes: list[SavedNode] = []
    beam_steps: int = 0

    @classmethod
    def of(cls, c: Column) -> SavedColumn:
        outs = [SavedOutput(index=o.index, tokens=[SavedToken.of(t) for t in o.tokens], token_ids=o.token_ids,
                            text=o.text, finish_reason=o.finish_reason, cumulative_logprob=o.cumulative_logprob,
                            score=o.score) for o in sorted(c.outputs.values(), key=lambda o: o.index)]
        return cls(mode=c.mode, status=c.status, request=c.request, error=c.error, error_code=c.error_code,
                   outputs=outs, submitted_at=c.submitted_at, first_token_at=c.first_token_at,
                   last_token_at=c.last_token_at, done=c.done, attempt=c.attempt, restarts=c.restarts,
                   beam_nodes=[SavedNode(**asdict(n)) for n in c.beam_tree.nodes.values()],
                   beam_steps=c.beam_tree.steps)

    def column(self) -> Column:
        self._check_beam_nodes()
        outputs = {o.index: Output(o.index, [t.token() for t in o.tokens], list(o.token_ids), o.text,
                                   o.finish_reason, o.cumulative_logprob, o.score) for o in self.outputs}
        tree = BeamTree({n.id: Node(**n.model_dump()) for n in self.beam_nodes} or {0: Node(0)}, self.beam_steps)
        return Column(self.mode, self.status, self.request, self.error, self.error_code, outputs=outputs,
                      submitted_at=self.submitted_at, first_token_at=self.first_token_at,
                      last_token_at=self.last_token_at, done=self.done, attempt=self.attempt,
                      restarts=self.restarts, beam_tree=tree)

    def _check_beam_nodes(self) -> None:
        """A tree the page can draw: the root 0, and every other node under an earlier step's node (a parent
        missing or a loop of parents made the drawing raise or never end; hypothesis found the first, session 43)."""
        nodes = {n.id: n for n in self.beam_nodes}
        if len(nodes) != len(self.beam_nodes):
            raise ShareError("beam_nodes: a node id repeats")
        if nodes and (0 not in nodes or nodes[0].parent is not None):
            raise ShareError("beam_nodes: no root node 0")
        for n in self.beam_nodes:
            parent = nodes.get(n.parent) if n.parent is not None else None
            if n.id and (parent is None or parent.step >= n.step):
                raise ShareError(f"beam_nodes: node {n.id}'s parent {n.parent} is not a node of an earlier step")
            if any(c not in nodes for c in n.children):
                raise ShareError(f"beam_nodes: node {n.id} has a child that is not a node")


class SavedBranch(_Saved):
    id: int
    column: SavedColumn
    parent: int | None = None
    fork_at: int = 0
    inherited: list[SavedToken] = []
    depth: int = 0


class SavedTree(_Saved):
    branches: list[SavedBranch]
    active: int = 0

    @classmethod
    def of(cls, tree: BranchTree) -> SavedTree:
        return cls(branches=[SavedBranch(id=b.id, column=SavedColumn.of(b.column), parent=b.parent, fork_at=b.fork_at,
                                         inherited=[SavedToken.of(t) for t in b.inherited], depth=b.depth)
                             for b in tree.branches], active=tree.active)

    def tree(self, mode: str) -> BranchTree:
        if not self.branches or any(b.id != i for i, b in enumerate(self.branches)):
            raise ShareError(f"trees.{mode}: branches must be numbered 0, 1, ... in order")
        if not 0 <= self.active < len(self.branches):
            raise ShareError(f"trees.{mode}.active: no branch {self.active}")
        for b in self.branches:  # a child carries its parent's tokens up to the fork and the picked one (branches.py)
            if b.parent is not None and len(b.inherited) != b.fork_at + 1:
                raise ShareError(f"trees.{mode}.branches[{b.id}]: a branch forked at {b.fork_at} inherits "
                                 f"{b.fork_at + 1} tokens, not {len(b.inherited)}")
        branches = [Branch(b.id, b.column.column(), b.parent, b.fork_at, [t.token() for t in b.inherited], b.depth)
                    for b in self.branches]
        return BranchTree(mode, branches, self.active)


class SavedRun(_Saved):
    kind: Literal["decodelab-run"] = KIND
    v: Literal[1] = VERSION
    saved_at: float
    settings: Settings
    share_prompt: bool = True
    trees: dict[str, SavedTree]
    rival: SavedColumn | None = None
    started_at: float
    message: str | None = None
    kv: list[KVSnapshot] = []
    kv_peak: KVSnapshot | None = None
    steps: dict[str, list[StepRecord]] = {}
    roofs: dict[str, dict] = {}


def _settings(s: Settings) -> Settings:
    """The controls' values as their types (sliders may give 64.0 for 64): the document then says 64."""
    try:
        return TypeAdapter(Settings).validate_python(asdict(s))
    except ValidationError as e:
        raise ShareError(f"settings: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None


def saved_run(run) -> SavedRun:
    """The run as a document (web.session.Run: not imported, it imports this module's neighbours)."""
    return SavedRun(saved_at=time.time(), settings=_settings(run.settings), share_prompt=run.share_prompt,
                    trees={m: SavedTree.of(t) for m, t in run.trees.items()},
                    rival=SavedColumn.of(run.rival) if run.rival is not None else None, started_at=run.started_at,
                    message=run.message, kv=run.kv, kv_peak=run.kv_peak, steps=run.step_lists(), roofs=run.roofs)


def restore(doc: SavedRun, run) -> None:
    """Fill a fresh Run (`run`) with the saved one: its columns, branches, snapshots and steps."""
    missing = [m for m in MODES if m not in doc.trees]
    if missing or set(doc.trees) - set(MODES):
        raise ShareError(f"trees: one per mode ({', '.join(MODES)}); got {', '.join(sorted(doc.trees))}")
    run.trees = {m: doc.trees[m].tree(m) for m in MODES}
    run.columns = {m: t.root.column for m, t in run.trees.items()}
    run.rival = doc.rival.column() if doc.rival is not None else None
    run.share_prompt, run.started_at, run.message = doc.share_prompt, doc.started_at, doc.message
    run.kv, run.kv_peak, run.roofs = list(doc.kv), doc.kv_peak, dict(doc.roofs)
    run.steps = {name: {s.step: s for s in steps} for name, steps in doc.steps.items()}


# ---- as text: a file, or a Redis value
def dumps(doc: SavedRun) -> str:
    text = doc.model_dump_json()
    if len(text) > MAX_FILE_BYTES:
        raise ShareError(f"run: {_mib(len(text))} is over the {MAX_FILE_BYTES >> 20} MiB a saved run may take "
                         "(fewer max tokens or fewer branches)")
    return text


def loads(text: str | bytes) -> SavedRun:
    """A document from a file's text; ShareError with the first problems when it is not a saved run."""
    check_file_size(len(text))
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShareError(f"run file: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ShareError("run file: not a DecodeLab run (no \"kind\": \"decodelab-run\")")
    if data.get("v") != VERSION:
        raise ShareError(f"run file: version {data.get('v')!r}, this playground reads version {VERSION}")
    if isinstance(data.get("settings"), dict):  # saved before "Adaptive k": its speculative column ran k a step
        data["settings"].setdefault("spec_adaptive", False)
    try:
        return SavedRun.model_validate(data)
    except ValidationError as e:
        first = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:3])
        raise ShareError(f"run file: {first}") from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def check_file_size(n: int) -> None:
    if n > MAX_FILE_BYTES:
        raise ShareError(f"run file: {n:,} bytes is over the {MAX_FILE_BYTES >> 20} MiB limit")


def pack(doc: SavedRun) -> str:
    """The Redis value: compressed JSON as base64 text, at most MAX_STORED_BYTES."""
    packed = base64.b64encode(zlib.compress(dumps(doc).encode(), 6)).decode()
    if len(packed) > MAX_STORED_BYTES:
        raise ShareError(f"run: {_mib(len(packed))} compressed is over the {MAX_STORED_BYTES >> 20} MiB a shared run "
                         "may take; download it as a file instead")
    return packed


def unpack(value: str) -> SavedRun:
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(value, validate=True), MAX_FILE_BYTES + 1)
    except (binascii.Error, zlib.error, ValueError):
        raise ShareError("run: the stored value is damaged") from None
    return loads(raw)


# ---- in Redis
def new_id() -> str:
    return secrets.token_urlsafe(12)  # 96 random bits: a link cannot be guessed


async def store(redis, keys: Keys, doc: SavedRun) -> str:
    """Save under a new id with the TTL; the id."""
    run_id = new_id()
    await redis.set(keys.shared_run(run_id), pack(doc), ex=TTL_S)
    return run_id


async def fetch(redis, keys: Keys, run_id: str) -> SavedRun:
    if not ID_RE.fullmatch(run_id or ""):
        raise ShareError(f"run: {run_id[:80]!r} is not a run id")
    value = await redis.get(keys.shared_run(run_id))
    if value is None:
        raise ShareError(f"run: no saved run {run_id} (links last {TTL_S // 86400} days)")
    return unpack(value)
