"""`decodelab play`: private Redis + replica + API front + web come up, print the playground's URL, and Ctrl-C
leaves no process behind."""
import os
import re
import signal
import subprocess
import sys

import httpx
import psutil

from engine_service.server.redis_server import free_port
from tests.helpers import ROOT, wait_until


def test_play_starts_everything_and_ctrl_c_stops_it_all(tiny_llama_dir, tmp_path):
    log = tmp_path / "play.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    engine_port, api_port, web_port = free_port(), free_port(), free_port()
    with open(log, "w") as out:
        play = subprocess.Popen(
            [sys.executable, "-m", "engine_service.cli", "play", "--model", str(tiny_llama_dir), "--threads", "1",
             "--num-kv-blocks", "256", "--engine-port", str(engine_port), "--api-port", str(api_port),
             "--web-port", str(web_port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_until(lambda: "is up" in log.read_text() or play.poll() is not None, 150, 0.2, "play to come up")
        text = log.read_text()
        assert play.poll() is None, text
        redis_port = int(re.search(r"redis: private redis-server on 127\.0\.0\.1:(\d+)", text).group(1))
        url = re.search(r"is up: (http://\S+)", text).group(1)
        assert httpx.get(f"http://127.0.0.1:{engine_port}/ready", timeout=5).status_code == 200
        # the OpenAI API is the front process, which reaches the replica through Redis
        models = httpx.get(f"http://127.0.0.1:{api_port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == str(tiny_llama_dir)
        done = httpx.post(f"http://127.0.0.1:{api_port}/v1/completions", timeout=60, json={
            "model": str(tiny_llama_dir), "prompt": "Hello", "max_tokens": 3, "temperature": 0}).json()
        assert done["usage"]["completion_tokens"] == 3, done
        assert url == f"http://127.0.0.1:{web_port}"
        page = httpx.get(url, timeout=30)  # the printed URL serves the playground (Gradio renders its config inline)
        assert page.status_code == 200
        assert 'content="DecodeLab playground"' in page.text and '"elem_id":"run"' in page.text
        children = psutil.Process(play.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert " engine " in names and " api " in names and " web " in names
        assert "--quantization int8" in names  # play's default on a CPU (play.apply_play_defaults)
        listening = {conn.laddr.port for c in children for conn in c.net_connections("tcp") if conn.status == "LISTEN"}
        assert redis_port in listening  # the private Redis-protocol server (its binary's name may vary)
        play.send_signal(signal.SIGINT)
        assert play.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if play.poll() is None:
            play.kill()
            play.wait(10)
