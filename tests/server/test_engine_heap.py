"""`decodelab engine` freezes its start-up heap (engine_cmd.freeze_heap): a real replica loaded by `_load` on the
tiny model and a real Redis, in a child process (a frozen heap would stay frozen in the test runner)."""
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import argparse, gc, sys, types
    from prometheus_client import CollectorRegistry
    from engine_service.engine.flags import add_engine_args
    from engine_service.server import engine_cmd
    from engine_service.server.api.state import ServiceState
    from engine_service.server.metrics import ReplicaMetrics
    from shared.client import EngineClient
    from shared.keys import Keys

    url, model, prefix = sys.argv[1:4]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_cmd.add_service_args(parser)
    args = parser.parse_args(["--model", model, "--redis-url", url, "--num-kv-blocks", "64", "--threads", "1"])
    registry = CollectorRegistry()
    state = ServiceState("tiny", EngineClient(url, Keys(prefix)), registry)
    server = types.SimpleNamespace(should_exit=False)
    engine_cmd._load(state, args, ReplicaMetrics(registry), server)
    assert state.load_error is None, state.load_error
    frozen = gc.get_freeze_count()
    junk = [[i] for i in range(1000)]  # made after start-up: the collector's as before
    young = sum(1 for o in gc.get_objects() if o is junk)
    state.replica.stop()
    print(frozen, young)
""")


def test_the_replica_freezes_what_start_up_made(redis_server, tiny_llama_dir):
    out = subprocess.run([sys.executable, "-c", CHILD, redis_server.url, str(tiny_llama_dir), "test-heap"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    frozen, young = map(int, out.stdout.split()[-2:])
    assert frozen > 50_000  # torch, transformers and the model: out of the full collections' walk
    assert young == 1  # later objects are still tracked (gc.get_objects lists no frozen ones)
