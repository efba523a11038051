"""`decodelab engine`: one replica (engine + Redis intake/publisher) and its HTTP API (health, metrics, OpenAI).

The API answers /health (and /ready = 503) while the model loads; on SIGINT / SIGTERM uvicorn ends open HTTP
streams, then the app's lifespan stops pulling, lets running requests finish (--drain-timeout) and exits.
The access log leaves out the answers to probes (`ProbeFilter`): `decodelab play`, compose and Kubernetes poll
/ready every second or so, and a model that loads for a minute would print a screen of `GET /ready 503` lines.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import threading

import uvicorn
from prometheus_client import CollectorRegistry

from engine_service.server.api.app import create_app
from engine_service.server.api.state import ServiceState
from engine_service.server.config import ReplicaConfig
from engine_service.server.metrics import ReplicaMetrics
from engine_service.server.replica import Replica
from shared.client import EngineClient
from shared.keys import Keys

log = logging.getLogger("decodelab.engine")

PROBES = ("/health", "/ready", "/metrics")  # polled by play, compose, Kubernetes and Prometheus


class ProbeFilter(logging.Filter):
    """Drops uvicorn's access-log lines of probes answered as expected: 200, or /ready's 503 while the model loads
    (or Redis is away: the replica logs that itself). Every other line stays, a probe's 500 or 404 included."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's access record: (client, method, path with query, http version, status)
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _, method, path, _, status = args
        return not (method == "GET" and str(path).split("?", 1)[0] in PROBES and status in (200, 503))


def quiet_probes() -> None:
    """Installs ProbeFilter on uvicorn's access logger (after uvicorn.Config, which configures that logger)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ProbeFilter) for f in access.filters):
        access.addFilter(ProbeFilter())


def http_config(app, args: argparse.Namespace, **kw) -> uvicorn.Config:
    """The HTTP server of `engine` and `api`: uvloop and httptools (dependencies, as in `uvicorn[standard]`) where
    they import, asyncio and h11 elsewhere. Every streamed token is a Redis message in and an SSE write out; with
    them and hiredis (redis-py's parser) the API's thread took ~30% less CPU per token (0.58-0.61 against 0.78-0.97
    CPU-s for 3,072 tokens in bursts of 8, AMD Zen 3; docs/benchmarks.md), CPU the engine's threads share."""
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), loop="auto",
                          http="auto", **kw)


def add_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    """Registered by cli.py (engine options come from cli.add_engine_args)."""
    return add_engine_parser(subparsers, add_engine_args)


def add_engine_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    p = subparsers.add_parser("engine", help="run one engine replica: Redis worker + HTTP API (OpenAI, metrics)")
    add_engine_args(p)
    add_service_args(p)
    p.set_defaults(func=run_engine)
    return p


def add_front_args(p: argparse.ArgumentParser, port_env: str, port: int) -> None:
    """What every HTTP process of the service takes: Redis, the address, the OpenAI API's limits."""
    env = os.environ.get
    p.add_argument("--served-model-name", default=None, help="model id in the OpenAI API (default: --model)")
    p.add_argument("--redis-url", default=env("REDIS_URL"), help="default: $REDIS_URL")
    p.add_argument("--host", default=env("DECODELAB_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env(port_env, port)))
    p.add_argument("--api-key", default=env("DECODELAB_API_KEY") or None, help="default: $DECODELAB_API_KEY")
    p.add_argument("--max-queue", type=int, default=int(env("DECODELAB_MAX_QUEUE", 256)),
                   help="requests waiting in Redis (per queue: the shared one, each replica's) beyond which new "
                        "ones are refused")
    p.add_argument("--max-inflight", type=int, default=int(env("DECODELAB_MAX_INFLIGHT", 4096)),
                   help="generation requests this API process holds open at once; beyond it answers 429")
    p.add_argument("--default-max-tokens", type=int, default=256, help="chat completions without max_tokens")
    p.add_argument("--log-level", default=env("DECODELAB_LOG_LEVEL", "info"))


def add_service_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_front_args(p, "DECODELAB_ENGINE_PORT", 8000)
    p.add_argument("--replica-name", default=None)
    p.add_argument("--role", default=env("DECODELAB_ROLE", "both"), choices=["both", "prefill", "decode"],
                   help="prefill/decode disaggregation: prefill replicas compute prompts and hand their KV blocks "
                        "to decode replicas through Redis")
    p.add_argument("--claim-idle", type=float, default=float(env("DECODELAB_CLAIM_IDLE_S", 10.0)),
                   help="seconds before a dead replica's request is re-run elsewhere")
    p.add_argument("--expected-tokens", type=int, default=int(env("DECODELAB_EXPECTED_TOKENS", 256)),
                   help="per-request KV estimate (prompt + output tokens) when deciding how many requests to pull; "
                        "lower admits more and relies on preemption when they outgrow the pool")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on shutdown, seconds to finish running requests")


def freeze_heap() -> int:
    """What is alive once the replica is up (the model, torch, transformers: ~380k objects for SmolLM2) out of the
    cyclic collector's reach (`gc.freeze`, as vLLM's servers do after start-up); returns how many objects that is.

    Otherwise a full collection walks all of them, holding the GIL: 262-296 ms once in each of three runs of eight
    128-token streams in the replica (AMD EPYC family 25 model 17, 2 cores), a stall of every stream it serves and of
    the engine thread; none in the same runs frozen, and the young collections' time ~half (session 47). Objects
    made later are collected as before; frozen ones are still freed by their reference counts."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _load(state: ServiceState, args, metrics: ReplicaMetrics, server) -> None:
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(engine_config_from_args(args))
        cfg = ReplicaConfig(args.redis_url, keys=state.client.keys, model_name=state.model_name,
                           claim_idle_s=args.claim_idle, expected_tokens=args.expected_tokens, role=args.role)
        if args.replica_name:
            cfg.name = args.replica_name
        state.replica = Replica(engine, cfg, metrics).start()
        log.info("replica %s ready: model %s (%d objects frozen)", cfg.name, state.model_name, freeze_heap())
    except Exception as e:
        log.exception("model load failed")
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True


class _Server(uvicorn.Server):
    """Stops the replica's intake at the signal itself: uvicorn first waits for open HTTP streams to end, and a
    replica still pulling meanwhile would take work it is about to abandon."""

    def __init__(self, config: uvicorn.Config, state: ServiceState):
        super().__init__(config)
        self.service = state

    def handle_exit(self, sig, frame) -> None:
        if (replica := self.service.replica) is not None:
            replica.state.pulling.clear()
            # routers must stop sending to it now, not at the next heartbeat (off the signal handler: Redis may hang)
            threading.Thread(target=replica.roles["control"].announce, daemon=True).start()
        super().handle_exit(sig, frame)


def run_engine(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.redis_url:
        raise SystemExit("decodelab engine: no Redis; pass --redis-url or set REDIS_URL (or use `decodelab play`)")
    registry = CollectorRegistry()
    client = EngineClient(args.redis_url, Keys.from_env(), max_queue=args.max_queue)
    state = ServiceState(model_name=args.served_model_name or args.model, client=client, registry=registry,
                         api_key=args.api_key, default_max_tokens=args.default_max_tokens,
                         drain_timeout=args.drain_timeout, max_inflight=args.max_inflight)
    app = create_app(state)
    # backlog: thousands of streaming clients may connect at once (the default queue is 2,048)
    config = http_config(app, args, backlog=4096)
    quiet_probes()
    server = _Server(config, state)
    loader = threading.Thread(target=_load, args=(state, args, ReplicaMetrics(registry), server), daemon=True)
    loader.start()  # the API answers /health (and /ready = 503) while the model loads
    # uvicorn restores the handlers it found and re-raises the signal after its graceful shutdown: with these in
    # place a drained replica exits 0 instead of dying of the signal it already handled
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()  # on SIGINT / SIGTERM: intake stops, HTTP streams end, the lifespan drains the replica
    return 0 if state.load_error is None else 1


def main(argv: list[str] | None = None) -> int:
    from engine_service.engine.flags import add_engine_args

    parser = argparse.ArgumentParser(prog="decodelab engine")
    add_engine_args(parser)
    add_service_args(parser)
    return run_engine(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
