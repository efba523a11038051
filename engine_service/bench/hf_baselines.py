"""Hugging Face transformers baselines for the throughput benchmark: static padded batches and
HF's own continuous batching. Both count only each request's own generated tokens."""
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine_service.bench.common import Workload


def load_hf(model_dir, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every request runs to its own max_tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_static(model, work: Workload, batch_size: int) -> dict:
    """Requests in arrival order, batch_size at a time, left-padded; a batch runs to its longest max_tokens."""
    computed_decode_slots, start = 0, time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts, outs = work.prompts[i:i + batch_size], work.max_tokens[i:i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs), min_new_tokens=max(outs))
        computed_decode_slots += len(prompts) * max(outs)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_per_s": work.output_tokens / elapsed, "batch_size": batch_size,
            "computed_decode_slots": computed_decode_slots,
            "useful_fraction": work.output_tokens / computed_decode_slots}


@torch.inference_mode()
def hf_continuous(model, work: Workload, max_batch_tokens: int = 2048, max_memory_percent: float = 0.3) -> dict:
    """HF's generate_batch machinery (ContinuousBatchingManager), with per-request max_new_tokens.
    Its cache is sized like ours (token budget per step, a share of memory): left to its GPU-minded
    defaults on CPU it spends minutes setting up before the first step."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_tokens), eos_token_id=-1,
                              pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in work.prompts),
                          max_generated_length=max(work.max_tokens), num_requests=len(work.prompts))
    done, generated = 0, 0
    start = time.perf_counter()
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_memory_percent=max_memory_percent)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30,
                                                   continuous_batching_config=cb_config, workload_hints=hints,
                                                   warmup=False) as manager:
        for prompt, out in zip(work.prompts, work.max_tokens):
            manager.add_request(prompt, max_new_tokens=out, eos_token_id=-1)
        while done < len(work.prompts):
            result = manager.get_result(timeout=300)
            if result is None:
                raise RuntimeError("HF continuous batching stalled")
            if result.is_finished():
                done += 1
                generated += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_per_s": generated / elapsed, "generated_tokens": generated}


def run_hf_baselines(model, work: Workload, batch_size: int, label: str = "",
                     which: tuple[str, ...] = ("hf_static", "hf_continuous")) -> dict:
    """The baselines named in `which`; one that breaks (a transformers change) is recorded as an error, not fatal."""
    out = {}
    runs = {"hf_static": lambda: hf_static(model, work, batch_size),
            "hf_continuous": lambda: hf_continuous(model, work)}
    for key, fn in ((k, runs[k]) for k in which):
        try:
            out[key] = fn()
            print(f"{label}{key}: {out[key]['tok_per_s']:.1f} tok/s", flush=True)
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{label}{key} failed: {out[key]['error']}", flush=True)
    return out
