"""`decodelab api`: the OpenAI front alone (/v1, /health, /ready, /metrics), in a process without an engine.

It submits to Redis and streams from it exactly as a replica's own API does, so any number of fronts and replicas
scale independently and the engine's busy loop never shares a process (and a GIL) with HTTP. It routes each request
to the replica holding the longest prefix of it (shared/router.py), tokenising with the model's tokenizer, which the
replicas publish to Redis. Ready once Redis answers and a live replica serves the model.
"""
from __future__ import annotations

import argparse
import logging

import uvicorn
from prometheus_client import CollectorRegistry

from engine_service.engine.config import EngineConfig
from engine_service.server.api.app import create_app
from engine_service.server.api.state import ServiceState
from engine_service.server.engine_cmd import add_front_args, http_config
from shared.client import EngineClient
from shared.keys import Keys


def add_parser(subparsers, add_engine_args=None) -> argparse.ArgumentParser:
    """Registered by cli.py."""
    p = subparsers.add_parser("api", help="run the OpenAI API front alone: it reaches replicas through Redis")
    add_front_args(p, "DECODELAB_API_PORT", 8000)
    p.set_defaults(func=run_api)
    return p


def run_api(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.redis_url:
        raise SystemExit("decodelab api: no Redis; pass --redis-url or set REDIS_URL")
    client = EngineClient(args.redis_url, Keys.from_env(), max_queue=args.max_queue)
    state = ServiceState(model_name=args.served_model_name or EngineConfig.model, client=client,
                         registry=CollectorRegistry(), api_key=args.api_key,
                         default_max_tokens=args.default_max_tokens, max_inflight=args.max_inflight, front=True)
    config = http_config(create_app(state, preload_tokenizer=True), args, backlog=4096, access_log=False)
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decodelab api")
    add_front_args(parser, "DECODELAB_API_PORT", 8000)
    return run_api(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
