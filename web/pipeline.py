"""A token's sampler pipeline as the click popup draws it (web/pipeline.js): the engine's stages (TokenEvent.stages,
params.sampler_stages) in a compact form for the token's `data-s` attribute.

Per stage: [name, kept, removed, other, chosen rank, chosen probability, [[id, text, p], ...]], probabilities to 4
decimals (the popup shows percentages to one). The column re-sends every token each frame, so a token carries only
what the popup draws: the SHOWN most likely tokens of each stage, and all the engine sent of the what-if's base
(the last stage before temperature), whose `other` is the mass beyond them. The playground asks for the pipeline
only while its "Sampler pipeline" box is ticked.
"""
from __future__ import annotations

import json
from html import escape

from shared.protocol import SamplerStage

SHOWN = 5  # bars per stage in the popup (pipeline.js SHOWN)
BASES = ("raw", "grammar", "penalties")  # the stages the what-if can start from: before temperature


def _p(x: float) -> float:
    return round(x, 4)


def stages_data(stages: list[SamplerStage]) -> list[list]:
    base = max((i for i, s in enumerate(stages) if s.name in BASES), default=-1)
    return [[s.name, s.kept, _p(s.removed), _p(s.other), s.chosen_rank, _p(s.chosen_prob),
             [[tid, text, _p(p)] for tid, text, p in (s.top if i == base else s.top[:SHOWN])]]
            for i, s in enumerate(stages)]


def stages_attr(stages: list[SamplerStage]) -> str:
    """` data-s='[...]'`: single quotes around the JSON, so its double quotes need no escaping (a third of the
    bytes otherwise)."""
    text = json.dumps(stages_data(stages), separators=(",", ":"))
    return " data-s='" + escape(text, quote=False).replace("'", "&#x27;") + "'"
