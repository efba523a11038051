"""The CPU-checkable half of CUDA graphs: bucketing, and that a decode batch padded into the static
buffers gives the same hidden states and the same KV cache as the batch run as it is."""
import torch

from engine_service import LLMEngine, SamplingParams
from engine_service.cli import build_parser, engine_config_from_args
from engine_service.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from tests.helpers import GREEDY


def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_a_batch_pads_up_to_the_next_captured_size_or_runs_eager_past_the_largest():
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert padded_size(101, sizes) is None


def test_enforce_eager_flag_reaches_the_config_and_cpu_runners_have_no_graphs(tiny_llama_dir):
    args = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--enforce-eager"])
    assert engine_config_from_args(args).enforce_eager is True
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=16)
    assert engine.config.enforce_eager is False and engine.runner.graphs is None


def decode_step_inputs(engine: LLMEngine, prompt_lens: list[int]):
    params = SamplingParams(max_tokens=8, **GREEDY)
    for i, n in enumerate(prompt_lens):
        engine.add_request(str(i), [3 + (7 * i + j) % 500 for j in range(n)], params)
    engine.step()  # prefill all prompts and sample their first token
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1] * len(prompt_lens)
    input_ids, positions, meta, _ = engine.runner.prepare(batch)
    return input_ids, positions, meta


@torch.inference_mode()
def test_padded_decode_batch_matches_unpadded_and_padding_writes_no_kv(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    runner = engine.runner
    input_ids, positions, meta = decode_step_inputs(engine, [5, 19, 30])
    before = runner.kv_cache.clone()
    expected = runner.model(input_ids, positions, meta)
    expected_kv = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)

    graphs = DecodeGraphs(runner.model, max_num_seqs=8, max_blocks_per_seq=16, device=runner.device)
    for buf, junk in [(graphs.input_ids, 7), (graphs.positions, 9), (graphs.slot_mapping, 5),
                      (graphs.block_tables, 3), (graphs.context_lens, 11)]:
        buf.fill_(junk)  # what an earlier, larger batch left behind
    size = graphs.load(input_ids, positions, meta)
    assert size == 4 and graphs.fits(3, meta)
    assert graphs.slot_mapping[3] == -1 and graphs.context_lens[3] == 1 and graphs.block_tables[3].eq(0).all()
    hidden = runner.model(*graphs.static_inputs(size))

    torch.testing.assert_close(hidden[:3], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.kv_cache, expected_kv, atol=1e-4, rtol=1e-4)  # a stray write is O(1)


def test_graphs_do_not_fit_prefill_oversized_or_too_wide_batches(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    model, device = engine.runner.model, engine.runner.device
    prompt = list(range(5, 25))  # longer than model_runner.DECODE_ROWS_MAX: a prefill chunk on the CPU too
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, **GREEDY))
    prefill = engine.runner.prepare(engine.scheduler.schedule())[2]
    assert not DecodeGraphs(model, 32, 16, device).fits(len(prompt), prefill)
    engine.abort("p")
    input_ids, positions, meta = decode_step_inputs(engine, [5, 19, 30])
    assert DecodeGraphs(model, 4, 16, device).fits(3, meta)
    assert not DecodeGraphs(model, 2, 16, device).fits(3, meta)
    assert not DecodeGraphs(model, 4, 3, device).fits(3, meta)  # 31 tokens need 4 blocks of 8
