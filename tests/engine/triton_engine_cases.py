# The engine with attention_backend="triton" against the torch backend, on CPU tensors under Triton's
# interpreter. Not collected by itself: test_triton_engine.py runs it in a fresh process with
# TRITON_INTERPRET=1 set before triton is first imported. Prompts and outputs stay short: the interpreter
# costs ~1 ms per program instance.
import os

from engine_service import LLM, EngineConfig, SamplingParams
from tests.helpers import GREEDY

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/engine/test_triton_engine.py"
# test_triton_engine.py also runs a test of test_cuda_graphs.py here, whose engine takes the default backend
assert EngineConfig(device="cpu").attention_backend == "triton", "set DECODELAB_ATTENTION_BACKEND=triton"


def test_greedy_tokens_match_torch_with_chunked_prefill_decode_mix_and_prefix_hits(tiny_llama_dir):
    shared = [3 + (5 * j) % 500 for j in range(17)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    # first alone, prefilled in chunks of <= 12 tokens; then a batch in which the second prompt hits its two
    # cached blocks of 8 and the 25-token one is chunked while the others already decode
    first = [shared + [7, 8]]
    batch = [[5, 6, 7], shared + [9], [3 + (13 * j) % 500 for j in range(25)]]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_dir), attention_backend=backend, block_size=8, num_kv_blocks=64,
                  max_num_batched_tokens=12)
        outs = llm.generate([{"prompt_token_ids": p} for p in first], params)
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], params)
        assert outs[2].metrics.cached_prompt_tokens == 16
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]


def test_copy_on_write_through_triton_copy_blocks_matches_torch(tiny_qwen2_dir):
    # n=2 forks after the prompt; its last block (11 tokens, blocks of 8) is shared and copied on write.
    # top_k=1 makes every sample the argmax, so both backends and both children must agree.
    params = SamplingParams(mode="sample", n=2, temperature=1.0, top_k=1, seed=0, ignore_eos=True, max_tokens=5)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_qwen2_dir), attention_backend=backend, block_size=8, num_kv_blocks=64)
        out = llm.generate({"prompt_token_ids": [3 + (11 * j) % 500 for j in range(11)]}, params)[0]
        assert llm.engine.stats().cow_copies > 0
        tokens[backend] = [c.token_ids for c in out.outputs]
    assert tokens["triton"] == tokens["torch"]
    assert tokens["triton"][0] == tokens["triton"][1]
