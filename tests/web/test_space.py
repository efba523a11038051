"""The Hugging Face Space entry point (top-level app.py): private Redis + replica + UI in one process tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
from gradio_client import Client

from engine_service.server.redis_server import free_port, redis_server_binary
from tests.helpers import ROOT, wait_until


def test_space_app_serves_the_playground_and_cleans_up(tiny_llama_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DECODELAB_REDIS_PREFIX")}
    env.update(DECODELAB_MODEL=str(tiny_llama_dir), DECODELAB_THREADS="1", DECODELAB_KV_BLOCKS="128",
               GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), OMP_NUM_THREADS="1")
    log = tmp_path / "space.log"
    with open(log, "w") as out:
        space = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert space.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, 0.2, "the Space UI")
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)

        def answered():
            result = client.predict(prompt="The capital of France is", chat=False, max_tokens=8, beams_shown=1,
                                    api_name="/run")
            return result if "columns" in result[-1] else None  # before the replica is up: "No engine replica"

        result = wait_until(answered, 60, 0.5, "the replica to answer")
        assert result[-1]["columns"]["greedy"]["status"] == "done"
        children = psutil.Process(space.pid).children(recursive=True)
        server = Path(redis_server_binary()).name  # valkey-server, or what DECODELAB_REDIS_SERVER names
        assert any(server in " ".join(c.cmdline()) for c in children)
        space.send_signal(signal.SIGTERM)
        assert space.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if space.poll() is None:
            space.kill()
            space.wait(10)
