# The engine with an int8 KV cache (kv_cache_dtype="int8") on the Triton backend against the torch backend,
# on CPU tensors under Triton's interpreter. Run by test_int8_kv.py in a fresh process with TRITON_INTERPRET=1.
import os

from engine_service import LLM, SamplingParams
from tests.helpers import GREEDY

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/engine/test_int8_kv.py"


def test_int8_kv_greedy_tokens_match_torch_with_chunked_prefill_prefix_hits_and_copy_on_write(tiny_llama_dir):
    shared = [3 + (5 * j) % 500 for j in range(17)]
    first = [shared + [7, 8]]
    batch = [[5, 6, 7], shared + [9]]
    fork = SamplingParams(mode="sample", n=2, temperature=1.0, top_k=1, seed=0, ignore_eos=True, max_tokens=5)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_dir), attention_backend=backend, kv_cache_dtype="int8", block_size=8,
                  num_kv_blocks=64, max_num_batched_tokens=12)
        params = SamplingParams(max_tokens=5, **GREEDY)
        outs = llm.generate([{"prompt_token_ids": p} for p in first], params)
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], params)
        assert outs[2].metrics.cached_prompt_tokens == 16
        forked = llm.generate({"prompt_token_ids": [3 + (11 * j) % 500 for j in range(11)]}, fork)[0]
        assert llm.engine.stats().cow_copies > 0
        tokens[backend] = [o.outputs[0].token_ids for o in outs] + [c.token_ids for c in forked.outputs]
    assert tokens["triton"] == tokens["torch"]
