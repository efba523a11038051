"""A token's sampler pipeline as the click popup draws it (web/pipeline.js): the engine's stages (TokenEvent.stages,
params.sampler_stages) in a compact form for the token's `data-s` attribute.

Per stage: [name, kept, removed, other, chosen rank, chosen probability, [[id, text, p], ...]], probabilities to 4
decimals (the popup shows percentages to one). The token carries it only when its request asked: the column re-sends
every token each frame, so the playground asks only while its "Sampler pipeline" box is ticked.
"""
from __future__ import annotations

from shared.protocol import SamplerStage


def _p(x: float) -> float:
    return round(x, 4)


def stages_data(stages: list[SamplerStage]) -> list[list]:
    return [[s.name, s.kept, _p(s.removed), _p(s.other), s.chosen_rank, _p(s.chosen_prob),
             [[tid, text, _p(p)] for tid, text, p in s.top]] for s in stages]
