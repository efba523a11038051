"""The child process of bench/llamacpp.py's single-stream anchor: one llama.cpp measurement, one JSON line out.

Kept apart, importing only the standard library and llama_cpp: a build for the wrong ISA dies here with SIGILL
(issue 25) rather than in the benchmark, and the child starts in a fraction of a second (no torch).
Usage: python -m engine_service.bench.llamacpp_child '{"gguf": ..., "threads": ..., "prompt_len": ...,
"new_tokens": ..., "runs": ...}'; LLAMA_CPP_LIB_PATH picks the libllama.so llama-cpp-python loads.
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def measure(gguf: str, threads: int, prompt_len: int, new_tokens: int, runs: int) -> dict:
    """`runs` greedy decodes of `new_tokens` tokens each; TPOT = (last - first) / (n - 1), 1 / median TPOT."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=prompt_len + new_tokens + runs + 8, n_batch=max(prompt_len, 8),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    tpots = []
    for r in range(runs):
        prompt = list(range(100 + r, 100 + r + prompt_len))  # the first token differs: no KV reuse between runs
        stamps = []
        tokens = llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        for _ in tokens:  # generate() never stops by itself: no EOS stop, as ignore_eos
            stamps.append(time.perf_counter())
            if len(stamps) == new_tokens:
                break
        tokens.close()
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    llm.close()
    tpot = statistics.median(tpots)
    return {"tok_per_s": 1 / tpot, "tpot_ms": tpot * 1e3, "runs": runs, "threads": threads,
            "prompt_tokens": prompt_len, "new_tokens": new_tokens, "gguf": gguf,
            "llama_cpp_version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))), flush=True)
