"""Engine replicas (`decodelab engine`) and API fronts (`decodelab api`) as real subprocesses, shared by the service
and web suites."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from engine_service.server.redis_server import die_with_parent, free_port
from shared.keys import Keys
from tests.helpers import ROOT, wait_until


class Replica:
    """`decodelab engine` as a real subprocess in its own process group (so kill -9 takes all of it)."""

    def __init__(self, model, redis_url: str, keys: Keys, name: str, *extra: str, served: str = "tiny",
                 drain_timeout: float = 1.0, env: dict[str, str] | None = None):
        self.name = name
        self._spawn(redis_url, keys, env, "engine", "--model", str(model), "--threads", "1", "--replica-name", name,
                    "--served-model-name", served, "--drain-timeout", str(drain_timeout), *extra)

    def _spawn(self, redis_url: str, keys: Keys, env: dict[str, str] | None, *argv: str) -> None:
        self.port = free_port()
        env = dict(os.environ, REDIS_URL=redis_url, DECODELAB_REDIS_PREFIX=keys.prefix, OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "engine_service.cli", *argv, "--port", str(self.port),
                                      "--log-level", "warning"], env=env, cwd=ROOT, start_new_session=True,
                                     preexec_fn=die_with_parent)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> Replica:
        def ready() -> bool:
            assert self.proc.poll() is None, f"replica {self.name} exited with {self.proc.returncode}"
            try:
                return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, 0.2, f"replica {self.name} ready")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Front(Replica):
    """`decodelab api`: the OpenAI front alone, ready once a replica serves `served`."""

    def __init__(self, redis_url: str, keys: Keys, *extra: str, served: str = "tiny",
                 env: dict[str, str] | None = None):
        self.name = "api"
        self._spawn(redis_url, keys, env, "api", "--served-model-name", served, *extra)
