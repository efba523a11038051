"""Which precision `play` and the Space run, and how the playground is told (the replica's heartbeat)."""
import argparse

import pytest

from engine_service.engine.config import EngineConfig
from engine_service.engine.flags import add_engine_args, engine_argv, engine_config_from_args
from engine_service.server.control import precision
from engine_service.server.play import apply_play_defaults
from web.handlers import service_html
from web.session import Service


def play_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_play_runs_int8_weights_on_a_cpu_and_the_float_weights_are_one_flag_away():
    args = play_args("--device", "cpu")
    apply_play_defaults(args)
    assert engine_argv(args)[-2:] == ["--quantization", "int8"]
    fp32 = play_args("--device", "cpu", "--quantization", "none")
    apply_play_defaults(fp32)
    assert engine_config_from_args(fp32).quantization is None
    assert engine_config_from_args(play_args(*engine_argv(fp32))).quantization is None  # as the replica parses it


def test_play_keeps_the_float_weights_on_a_gpu():
    args = play_args("--device", "cuda")
    apply_play_defaults(args)
    assert args.quantization is None


@pytest.mark.parametrize("config, shown", [
    (EngineConfig(device="cpu"), "float32"),
    (EngineConfig(device="cpu", quantization="int8"), "int8 weights, fp16 KV"),  # the cache's default there
    (EngineConfig(device="cpu", quantization="int8", kv_cache_dtype="fp32"), "int8 weights"),
    (EngineConfig(device="cpu", quantization="int8", kv_cache_dtype="int8"), "int8 weights, int8 KV"),
    (EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="int8"), "bfloat16, int8 KV"),
])
def test_the_precision_a_replica_reports(config, shown):
    assert precision(config) == shown


def test_the_service_line_names_model_and_precision():
    html = service_html(Service("redis://127.0.0.1:1"), True,
                        {"r1": {"model": "smollm2-135m", "running": 2, "precision": "int8 weights"}})
    assert "smollm2-135m (int8 weights)" in html and "2 running" in html


def test_play_leaves_one_core_to_the_web_ui_and_the_browser_on_a_cpu(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    args = play_args("--device", "cpu")
    apply_play_defaults(args)
    assert engine_config_from_args(args).num_threads == 1
    assert engine_config_from_args(play_args(*engine_argv(args))).num_threads == 1  # as the replica parses it
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    args = play_args("--device", "cpu")
    apply_play_defaults(args)
    assert args.threads == 7
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    args = play_args("--device", "cpu")
    apply_play_defaults(args)
    assert args.threads == 1
    given = play_args("--device", "cpu", "--threads", "2")  # a flag wins
    apply_play_defaults(given)
    assert engine_config_from_args(given).num_threads == 2
    gpu = play_args("--device", "cuda")
    apply_play_defaults(gpu)
    assert gpu.threads is None
