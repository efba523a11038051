"""KV blocks exported by one engine and imported into another's prefix cache: the decode engine's output equals the
colocated output in every mode, the imported blocks are hit, and wrong or oversized transfers are refused."""
import pytest

from engine_service.engine.kv_transfer import export_prompt_blocks, import_prompt_blocks
from engine_service.engine.llm import LLM
from engine_service.engine.sampling_params import SamplingParams
from tests.helpers import GREEDY, random_prompt

KW = dict(num_kv_blocks=64, max_num_seqs=8, block_size=16)
MODES = {
    "greedy": SamplingParams(max_tokens=12, **GREEDY),
    "sample": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True),
    "beam": SamplingParams(max_tokens=8, mode="beam", beam_width=3, n=2, temperature=0, ignore_eos=True),
    "speculative": SamplingParams(max_tokens=12, mode="speculative", proposer="ngram", **GREEDY),
}


@pytest.fixture(params=["float32", "int8"])
def engines(request, tiny_llama_dir):
    kv = {"kv_cache_dtype": "int8"} if request.param == "int8" else {}
    return LLM(str(tiny_llama_dir), **KW, **kv), LLM(str(tiny_llama_dir), **KW, **kv)


def _prefill(llm: LLM, prompt: list[int]):
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))
    return export_prompt_blocks(llm.engine, prompt)


@pytest.mark.parametrize("mode", MODES)
def test_a_decode_engine_fed_the_prefill_blocks_gives_the_colocated_output(engines, mode):
    prefill, decode = engines
    prompt = random_prompt(70, seed=3)  # 4 full blocks and a tail of 6
    blocks = _prefill(prefill, prompt)
    assert len(blocks.hashes) == 4 and blocks.num_tokens == 64
    assert import_prompt_blocks(decode.engine, prompt, blocks) == 64
    out = decode.generate([{"prompt_token_ids": prompt}], MODES[mode])[0]
    assert out.metrics.cached_prompt_tokens == 64  # only the tail was computed again
    want = prefill.generate([{"prompt_token_ids": prompt}], MODES[mode])[0]  # colocated (its own cache)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]


def test_blocks_of_another_prompt_are_not_imported(engines):
    prefill, decode = engines
    blocks = _prefill(prefill, random_prompt(40, seed=1))
    other = random_prompt(40, seed=2)
    assert import_prompt_blocks(decode.engine, other, blocks) == 0
    assert not decode.engine.block_manager.cached


def test_a_diverging_prompt_imports_the_shared_leading_blocks_only(engines):
    prefill, decode = engines
    prompt = random_prompt(64, seed=4)
    blocks = _prefill(prefill, prompt)
    changed = prompt[:40] + [7] * 24  # the third block differs
    assert import_prompt_blocks(decode.engine, changed, blocks) == 32


def test_a_full_pool_imports_what_fits_and_the_rest_is_computed(tiny_llama_dir):
    prefill = LLM(str(tiny_llama_dir), **KW)
    decode = LLM(str(tiny_llama_dir), **{**KW, "num_kv_blocks": 3})
    prompt = random_prompt(80, seed=5)
    blocks = _prefill(prefill, prompt)
    assert len(blocks.hashes) == 5
    decode.engine.block_manager.allocate(_Holder(), 48)  # everything but nothing: all 3 blocks held
    assert import_prompt_blocks(decode.engine, prompt, blocks) == 0


def test_blocks_of_another_layout_are_refused(tiny_llama_dir):
    prefill = LLM(str(tiny_llama_dir), **KW)
    decode = LLM(str(tiny_llama_dir), **KW, kv_cache_dtype="int8")
    prompt = random_prompt(40, seed=6)
    with pytest.raises(ValueError, match="kv transfer"):
        import_prompt_blocks(decode.engine, prompt, _prefill(prefill, prompt))


class _Holder:
    """A sequence-shaped holder of blocks (block_manager takes any object with these fields)."""

    def __init__(self):
        self.token_ids, self.num_computed_tokens, self.block_table, self.block_hashes = [], 0, [], []
