"""Hugging Face transformers as the oracle: greedy token ids, and the near-tie check for divergences."""
from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=4)
def hf_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # our runs use ignore_eos; compare full lengths
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(str(model_dir))
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def top2_gap(model_dir, ids: list[int]) -> float:
    logits = hf_model(str(model_dir))(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_matches(model_dir, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> None:
    """Token-exact, except that a divergence is allowed only at a near-tie (top-2 logit gap < 1e-4)."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = top2_gap(model_dir, prompt_ids + theirs[:i])
            assert gap < 1e-4, f"diverged at token {i} ({a} vs HF {b}) with top-2 gap {gap:.2e}: a bug, not a tie"
            return
