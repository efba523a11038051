"""EngineConfig as command-line flags, from one table.

`add_engine_args` (the parsers of generate, engine, play and the benchmarks), `engine_config_from_args`
and `engine_argv` (how `play` and `bench serve` pass the same options on to `decodelab engine`) all
read ENGINE_FLAGS, and each flag's type and default come from its EngineConfig field, so a flag cannot
be parsed but dropped, nor default differently from the config. tests/engine/test_cli_flags.py checks
that every field has a flag. Lives beside the config (not in cli.py) so the server and benchmarks,
which sit below the command line, can use it.
"""
import argparse
from dataclasses import dataclass, fields

from engine_service.engine.config import EngineConfig

_FIELDS = {f.name: f for f in fields(EngineConfig)}


@dataclass(frozen=True)
class EngineFlag:
    flag: str
    field: str  # the EngineConfig field it sets
    help: str | None = None
    choices: tuple[str, ...] | None = None
    negated: bool = False  # a store_true `--no-...` flag that turns a default-True field off

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def add_to(self, p: argparse.ArgumentParser) -> None:
        f = _FIELDS[self.field]
        if f.type is bool:
            assert f.default is self.negated, f"{self.flag}: a switch must turn its field's default around"
            p.add_argument(self.flag, action="store_true", help=self.help)
            return
        kind = next(t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None))  # X | None -> X
        p.add_argument(self.flag, type=kind, default=f.default, choices=self.choices, help=self.help)

    def value(self, args: argparse.Namespace):
        value = getattr(args, self.dest)
        return not value if self.negated else value

    def argv(self, args: argparse.Namespace) -> list[str]:
        value = getattr(args, self.dest)
        if _FIELDS[self.field].type is bool:
            return [self.flag] if value else []
        return [] if value is None else [self.flag, str(value)]


ENGINE_FLAGS = (
    EngineFlag("--model", "model", "registry name, HF model directory or .gguf path"),
    EngineFlag("--dtype", "dtype", "default: float32 on CPU, bfloat16 on CUDA", ("float32", "float16", "bfloat16")),
    EngineFlag("--device", "device", "cpu, cuda, cuda:N or auto"),
    EngineFlag("--kv-cache-memory", "kv_cache_memory", "bytes, or a fraction (<= 1) of free memory"),
    EngineFlag("--num-kv-blocks", "num_kv_blocks", "KV pool size in blocks (overrides --kv-cache-memory)"),
    EngineFlag("--block-size", "block_size", "tokens per KV block (a power of two)"),
    EngineFlag("--max-num-seqs", "max_num_seqs", "sequences running at once"),
    EngineFlag("--max-num-batched-tokens", "max_num_batched_tokens", "tokens per step"),
    EngineFlag("--max-model-len", "max_model_len", "prompt + output tokens (default: the model's)"),
    EngineFlag("--attention-backend", "attention_backend", "default: triton on CUDA, torch on CPU",
               ("torch", "triton")),
    EngineFlag("--enforce-eager", "enforce_eager", "no CUDA graphs for decode steps"),
    EngineFlag("--max-beam-width", "max_beam_width", "largest beam_width a request may ask for"),
    EngineFlag("--draft-model", "draft_model", "draft model for the speculative `draft` proposer"),
    EngineFlag("--cache-dir", "cache_dir",
               "converted models (default: $DECODELAB_CACHE_DIR or ~/.cache/decodelab/models)"),
    EngineFlag("--no-prefix-caching", "enable_prefix_caching", "do not reuse KV blocks of shared prefixes",
               negated=True),
    EngineFlag("--threads", "num_threads", "torch CPU threads"),
    EngineFlag("--engine-seed", "seed", "torch's global seed at load"),
    EngineFlag("--kv-cache-dtype", "kv_cache_dtype", "auto: the model's dtype, fp16 under int8 weights on a CPU; "
               "fp16: K/V rounded to fp16 (2x the tokens of fp32, half the reads); int8: int8 K/V with per-token "
               "scales (~4x the tokens of fp32; approximate)", ("auto", "fp32", "fp16", "int8")),
    EngineFlag("--quantization", "quantization", "int8: int8 weights, activations quantized per step "
               "(faster on CPU, approximate); none: the model's float weights", ("int8", "none")),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for f in ENGINE_FLAGS:
        f.add_to(p)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.field: f.value(args) for f in ENGINE_FLAGS})


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` (add_engine_args) as arguments that parse back to the same config."""
    return [token for f in ENGINE_FLAGS for token in f.argv(args)]
