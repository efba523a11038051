"""Tiny random Llama / Qwen2 models with a real (tiny) BPE tokenizer, saved as HF directories.

Both share one byte-level BPE vocabulary (512 tokens, so any text encodes); note that AutoTokenizer
loads the qwen2 directory as Qwen2Tokenizer, whose pre-tokenizer splits digits, so ids for the same
text can differ between the two architectures (as they would for real models).
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (unk/pad), 1 (bos), 2 (eos)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = """
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Readability counts. Errors should never pass silently, unless they are explicitly silenced.
The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid.
A language model reads a prompt one token at a time and predicts the next token. Greedy decoding
always picks the most likely token; sampling draws from the distribution, shaped by a temperature.
The quick brown fox jumps over the lazy dog. Once upon a time there was a small robot who wanted
to learn how to write poems. Every morning it read a page of a book and wrote down new words.
def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
Numbers like 1, 2, 3, 42 and 2024 appear in text too, and so do questions: what is the time? Where
are we going? How many tokens fit in a block of the cache? Sixteen, if the block size is sixteen.
"""

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def make_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def make_model(arch: str, vocab_size: int, seed: int = 0, num_layers: int = 2, std: float = 0.3, **config_kw):
    """`config_kw` overrides the config (e.g. rope_parameters); the weights depend on the seed and sizes only."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(**{
        **dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               tie_word_embeddings=(arch == "llama"), bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32"),
        **config_kw})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF's init (std 0.02, zero biases, unit norms) gives near-tied logits; spread it out
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    return model


def save_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, num_layers: int = 2, **config_kw) -> Path:
    """Write a tiny random `arch` model plus tokenizer to out_dir as a HF directory; return the path."""
    out = Path(out_dir)
    tokenizer = make_tokenizer()
    make_model(arch, len(tokenizer), seed=seed, num_layers=num_layers, **config_kw).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
