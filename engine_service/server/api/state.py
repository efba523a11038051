"""What the HTTP app holds: the Redis client, limits, and the replica once its model has loaded."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from engine_service.server.api.admission import RETRY_AFTER_S
from engine_service.server.metrics import RouteMetrics
from engine_service.server.replica import Replica
from shared.client import EngineClient
from shared.limits import Limits
from shared.router import Router


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers


def not_ready(model: str, why: str) -> APIError:
    """The 503 of a route that needs the model while it cannot be served (loading, failed, no replica)."""
    return APIError(503, f"model {model!r} is not ready: {why}", "service_unavailable", "model_not_ready",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass
class ServiceState:
    model_name: str
    client: EngineClient
    registry: CollectorRegistry
    api_key: str | None = None
    default_max_tokens: int = 256
    request_timeout: float = 600.0
    drain_timeout: float = 30.0
    max_inflight: int = 4096  # generation requests open at once in this process (api/admission.py)
    sse_keepalive_s: float = 5.0  # a stream with no event for this long gets a `: keep-alive` comment
    limits: Limits = field(default_factory=Limits.from_env)
    replica: Replica | None = None  # set once the model is loaded
    front: bool = False  # `decodelab api`: no replica in this process; ready once one serves the model
    route_metrics: RouteMetrics | None = None
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)

    _tokenizers: Router | None = None  # a front's, where it does not route (DECODELAB_ROUTING=0)

    def __post_init__(self) -> None:
        if self.route_metrics is None:
            self.route_metrics = RouteMetrics(self.registry)

    def tokenizers(self) -> Router:
        """Where a front gets the model's tokenizer (published by the replicas): its router's, or one of its own."""
        if self.client.router is not None:
            return self.client.router
        if self._tokenizers is None:
            self._tokenizers = Router(self.client.redis, self.client.keys)
        return self._tokenizers
