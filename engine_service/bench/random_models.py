"""Randomly initialised Qwen2 models at real shapes, saved as HF directories the engine can load.

Decode speed does not depend on the weight values, so the GPU benchmark needs no download: the
Qwen2.5-Coder 1.5B (target) and 0.5B (draft) hyper-parameters are enough. The tokenizer is a word-level
one over the same vocabulary ("t123" for id 123): enough to decode any id, so prompts are token ids.
"""
from pathlib import Path

import torch

COMMON = dict(vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=32768,
              rms_norm_eps=1e-6)
SHAPES = {  # from the Qwen2.5-Coder config.json files
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, intermediate_size=8960, **COMMON),
    "qwen2.5-coder-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, intermediate_size=4864, **COMMON),
    # --tiny: plumbing only (head_dim 16, the least the Triton kernels take)
    "tiny-target": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=2048, rope_theta=1e4, tie_word_embeddings=True,
                        max_position_embeddings=4096),
    "tiny-draft": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=2048, rope_theta=1e4, tie_word_embeddings=True,
                       max_position_embeddings=4096),
}
UNK, EOS = 0, 1


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": UNK, "<eos>": EOS, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>")


def save_random_model(out_dir: str | Path, name: str, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """HF's own initialisation (std 0.02), built on `device` (fast on a GPU), saved in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[name], bos_token_id=EOS, eos_token_id=EOS, pad_token_id=UNK)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    word_tokenizer(config.vocab_size).save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out
