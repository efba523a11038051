"""`decodelab play`: private Redis + replica + API front + web come up, print the playground's URL, and Ctrl-C leaves
no process behind; its console shows no access-log line per readiness poll (engine_cmd.ProbeFilter)."""
import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from engine_service.server.engine_cmd import ProbeFilter
from engine_service.server.redis_server import free_port
from tests.helpers import ROOT, wait_until


@dataclass
class Play:
    proc: subprocess.Popen
    log: Path
    engine_port: int
    api_port: int
    web_port: int

    def console(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def play(tiny_llama_dir, tmp_path_factory):
    """One `decodelab play` for the module, up (its URL printed); killed at the end if a test left it running."""
    log = tmp_path_factory.mktemp("play") / "play.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    engine_port, api_port, web_port = free_port(), free_port(), free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_service.cli", "play", "--model", str(tiny_llama_dir), "--threads", "1",
             "--num-kv-blocks", "256", "--engine-port", str(engine_port), "--api-port", str(api_port),
             "--web-port", str(web_port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_until(lambda: "is up" in log.read_text() or proc.poll() is not None, 150, 0.2, "play to come up")
        assert proc.poll() is None, log.read_text()
        yield Play(proc, log, engine_port, api_port, web_port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_play_start_up_prints_no_line_per_readiness_poll(play):
    up = play.console().split("is up")[0]  # the start-up: play polled the engine's /ready until the model loaded
    assert "Uvicorn running" in up and "ready: model" in up  # the engine's log reaches the console
    assert "/ready" not in up, up


def test_the_engine_still_logs_real_requests_and_errors(play):
    base = f"http://127.0.0.1:{play.engine_port}"
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200
    assert httpx.get(f"{base}/no-such-route", timeout=10).status_code == 404
    wait_until(lambda: '"GET /no-such-route HTTP/1.1" 404' in play.console(), 10, 0.1, "the 404's access line")
    assert '"GET /v1/models HTTP/1.1" 200' in play.console()


def access_record(path: str, status: int, method: str = "GET") -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


@pytest.mark.parametrize("path,status,shown", [
    ("/ready", 503, False), ("/ready", 200, False), ("/health", 200, False), ("/metrics", 200, False),
    ("/ready?verbose=1", 503, False),
    ("/ready", 500, True), ("/health", 404, True), ("/v1/models", 200, True), ("/v1/completions", 503, True),
])
def test_probe_filter_drops_only_probes_answered_as_expected(path, status, shown):
    assert ProbeFilter().filter(access_record(path, status)) is shown
    assert ProbeFilter().filter(logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 0, "boom", None, None))


def test_play_starts_everything_and_ctrl_c_stops_it_all(play):
    text = play.console()
    redis_port = int(re.search(r"redis: private redis-server on 127\.0\.0\.1:(\d+)", text).group(1))
    url = re.search(r"is up: (http://\S+)", text).group(1)
    assert httpx.get(f"http://127.0.0.1:{play.engine_port}/ready", timeout=5).status_code == 200
    # the OpenAI API is the front process, which reaches the replica through Redis
    api, model = f"http://127.0.0.1:{play.api_port}", re.search(r"--model (\S+)", " ".join(
        " ".join(c.cmdline()) for c in psutil.Process(play.proc.pid).children(recursive=True))).group(1)
    assert httpx.get(f"{api}/v1/models", timeout=5).json()["data"][0]["id"] == model
    done = httpx.post(f"{api}/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}).json()
    assert done["usage"]["completion_tokens"] == 3, done
    assert url == f"http://127.0.0.1:{play.web_port}"
    page = httpx.get(url, timeout=30)  # the printed URL serves the playground (Gradio renders its config inline)
    assert page.status_code == 200
    assert 'content="DecodeLab playground"' in page.text and '"elem_id":"run"' in page.text
    children = psutil.Process(play.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert " engine " in names and " api " in names and " web " in names
    assert "--quantization int8" in names  # play's default on a CPU (play.apply_play_defaults)
    listening = {conn.laddr.port for c in children for conn in c.net_connections("tcp") if conn.status == "LISTEN"}
    assert redis_port in listening  # the private Redis-protocol server (its binary's name may vary)
    play.proc.send_signal(signal.SIGINT)
    assert play.proc.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def test_play_lets_openmp_threads_sleep_only_where_the_engine_takes_every_core(monkeypatch):
    from engine_service.server import play

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    # a core left to the web UI and the browser (play's default: cores - 1): the threads spin, as in a deployment
    assert "OMP_WAIT_POLICY" not in play.stack_env("redis://x", 3)
    # every core the engine's (or unknown): they sleep at their barriers and leave the cores to the UI
    assert play.stack_env("redis://x", 4)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert play.stack_env("redis://x")["OMP_WAIT_POLICY"] == "PASSIVE"
    # the benches' deployments (route, pd, aggregate --via front) have no UI on the cores
    assert "OMP_WAIT_POLICY" not in play.service_env("redis://x") and play.service_env("redis://x")["REDIS_URL"]
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice stays
    assert play.stack_env("redis://x", 4)["OMP_WAIT_POLICY"] == "ACTIVE"


# a main loop waiting on play's stop flag while SIGTERM keeps arriving (every 2 ms for 2 s): with a threading.Event
# as the flag, a signal landing inside Event.wait() ran its handler's set() against the lock wait() held, and the
# process hung for good (it did once under `make play`, and this script hung within seconds)
_FLOOD = """
import os, signal, threading, time
from engine_service.server.play import StopFlag, stop_on_signals
stop = StopFlag()
stop_on_signals(stop)
def flood():
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.002)
t = threading.Thread(target=flood)
t.start()
end = time.monotonic() + 2.2
while time.monotonic() < end:
    stop.wait(0.001)
t.join()
print("stopped" if stop.is_set() else "never set")
"""


def test_play_stop_flag_takes_signals_inside_its_wait_without_hanging():
    # SIGKILL on timeout (the script catches SIGTERM itself)
    out = subprocess.run([sys.executable, "-c", _FLOOD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "stopped"
