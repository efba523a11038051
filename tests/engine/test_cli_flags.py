"""Engine flags: every EngineConfig field has one, and `decodelab play` passes all of them to its replica."""
import argparse
from dataclasses import fields

from engine_service.cli import build_parser
from engine_service.engine.config import EngineConfig
from engine_service.engine.flags import ENGINE_FLAGS, add_engine_args, engine_config_from_args
from engine_service.server.play import engine_argv

# Every field away from its default, in the flags a user types.
NON_DEFAULT = {
    "model": ["--model", "org/tiny"],
    "dtype": ["--dtype", "bfloat16"],
    "device": ["--device", "cpu"],
    "block_size": ["--block-size", "32"],
    "kv_cache_memory": ["--kv-cache-memory", "0.125"],
    "num_kv_blocks": ["--num-kv-blocks", "77"],
    "max_num_seqs": ["--max-num-seqs", "9"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "333"],
    "max_model_len": ["--max-model-len", "1000"],
    "enable_prefix_caching": ["--no-prefix-caching"],
    "attention_backend": ["--attention-backend", "triton"],
    "enforce_eager": ["--enforce-eager"],
    "max_beam_width": ["--max-beam-width", "3"],
    "draft_model": ["--draft-model", "org/draft"],
    "cache_dir": ["--cache-dir", "/tmp/models"],
    "num_threads": ["--threads", "3"],
    "seed": ["--engine-seed", "5"],
    "quantization": ["--quantization", "int8"],
    "kv_cache_dtype": ["--kv-cache-dtype", "int8"],
}
EXPECTED = EngineConfig(model="org/tiny", dtype="bfloat16", device="cpu", block_size=32, kv_cache_memory=0.125,
                        num_kv_blocks=77, max_num_seqs=9, max_num_batched_tokens=333, max_model_len=1000,
                        enable_prefix_caching=False, attention_backend="triton", enforce_eager=True,
                        max_beam_width=3, draft_model="org/draft", cache_dir="/tmp/models", num_threads=3, seed=5,
                        quantization="int8", kv_cache_dtype="int8")


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def all_flags() -> list[str]:
    return [token for argv in NON_DEFAULT.values() for token in argv]


def test_every_engine_config_field_has_a_flag():
    assert {f.field for f in ENGINE_FLAGS} == {f.name for f in fields(EngineConfig)}
    assert set(NON_DEFAULT) == {f.name for f in fields(EngineConfig)}  # this spec covers them all too


def test_flags_set_every_engine_config_field():
    assert engine_config_from_args(engine_parser().parse_args(all_flags())) == EXPECTED


def test_no_flags_give_the_engine_config_defaults():
    assert engine_config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_play_passes_every_engine_flag_to_its_replica():
    args = build_parser().parse_args(["play", *all_flags()])
    again = engine_parser().parse_args(engine_argv(args))
    assert engine_config_from_args(again) == EXPECTED


def test_play_passes_defaults_through_unchanged():
    args = build_parser().parse_args(["play"])
    assert engine_config_from_args(engine_parser().parse_args(engine_argv(args))) == EngineConfig()
