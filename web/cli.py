"""`decodelab web`: registered without importing gradio, so other commands start fast."""
import argparse
import os


def add_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    del add_engine_args  # the web has no engine: it only needs Redis
    env = os.environ.get
    p = subparsers.add_parser("web", help="the Gradio playground (talks to the engine replicas through Redis)")
    p.add_argument("--redis-url", default=env("REDIS_URL"), help="default: $REDIS_URL")
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", 7860)))
    p.set_defaults(func=run_web)
    return p


def run_web(args: argparse.Namespace) -> int:
    if not args.redis_url:
        raise SystemExit("decodelab web: no Redis; pass --redis-url or set REDIS_URL (or use `decodelab play`)")
    from shared.keys import Keys
    from web.app import build_app, launch
    from web.session import Service

    launch(build_app(Service(args.redis_url, Keys.from_env())), args.host, args.port)
    return 0
