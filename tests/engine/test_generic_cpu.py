"""A CPU without AVX2 (an arm64 laptop or container): every choice takes its PyTorch fallback (no C kernel builds,
no fbgemm), and the playground's engine (SmolLM2, int8 weights) still runs all four modes with greedy tokens equal to
Hugging Face's fp32 ones. On x86 `DECODELAB_CPU_ISA=generic` stands in for such a CPU; on any other architecture the
test runs as it is (`make test-arm64` runs it on arm64 Python under QEMU: tests/arm64/). In a fresh process: the
kernel choices are made once per process."""
import json
import os
import platform
import subprocess
import sys

import pytest

from decodelab_kernels._cbuild import is_x86
from tests.hf_oracle import assert_greedy_matches, hf_greedy

SCRIPT = r"""
import json
from engine_service import LLM, SamplingParams
from engine_service.engine.models import int8_linear
from decodelab_kernels import cpu_decode_attention, cpu_decoder, cpu_int8, cpu_layer_ops, cpu_logits
import torch

why = {k.__name__.split(".")[-1]: k.unavailable()
       for k in (cpu_int8, cpu_decode_attention, cpu_layer_ops, cpu_logits, cpu_decoder)}
llm = LLM("smollm2-135m", quantization="int8", num_kv_blocks=64)
prompt = llm.tokenizer("The three primary colours are", add_special_tokens=False).input_ids
common = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
modes = {"greedy": SamplingParams(**common),
         "beam": SamplingParams(mode="beam", beam_width=2, **common),
         "sample": SamplingParams(mode="sample", temperature=0.8, top_k=40, seed=1, ignore_eos=True, max_tokens=12),
         "speculative": SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=3, **common)}
outs = llm.generate([{"prompt_token_ids": prompt}] * 4, list(modes.values()))
print(json.dumps({"why": why, "int8_kernel": int8_linear.int8_kernel(torch.device("cpu")), "prompt": prompt,
                  "tokens": {m: o.outputs[0].token_ids for m, o in zip(modes, outs)},
                  "fused": bool(llm.engine.runner.model.fused_decode)}))
"""


@pytest.mark.slow
def test_without_avx2_the_int8_playground_engine_runs_every_mode_on_pytorch_paths(smollm2_dir):
    x86 = is_x86()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for switch in ("DECODELAB_CPU_ISA", "DECODELAB_INT8_KERNEL", "DECODELAB_CPU_KERNELS"):
        env.pop(switch, None)
    if x86:
        env["DECODELAB_CPU_ISA"] = "generic"
    # elsewhere the run may be emulated (QEMU runs this step in ~10 minutes)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600 if x86 else 3600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    reason = "DECODELAB_CPU_ISA=generic" if x86 else f"not an x86 CPU ({platform.machine()})"
    assert all(w and reason in w for w in got["why"].values()), got["why"]
    assert got["int8_kernel"] == "dequant" and not got["fused"]
    tokens = got["tokens"]
    assert all(len(t) == 12 for t in tokens.values())
    assert tokens["speculative"] == tokens["greedy"]
    # a Q4_1 GGUF's weights are kept exactly in groups of 32, and dequant multiplies them in fp32: HF's fp32 tokens
    assert_greedy_matches(smollm2_dir, got["prompt"], tokens["greedy"], hf_greedy(smollm2_dir, got["prompt"], 12))
