"""Prometheus metrics of one replica: request latencies (observed as events are built) and engine gauges (read
from the replica's latest stats snapshot at scrape time)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80)


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry):
        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"decodelab_{name}", doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Request created -> first token")
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token events of a request")
        self.queue = hist("queue_time_seconds", "Request created -> picked up by a replica")
        self.e2e = hist("e2e_request_latency_seconds", "Request created -> finished")
        self.batch = hist("batch_size", "Requests advanced per engine step", (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.finished = Counter("decodelab_requests", "Finished requests by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("decodelab_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generated = Counter("decodelab_generation_tokens", "Tokens generated", registry=registry)


class RouteMetrics:
    """The routing decisions of one submitting process (an API front, a replica's API)."""

    def __init__(self, registry: CollectorRegistry):
        self.seconds = Histogram("decodelab_route_seconds", "Routing decision: tokenise, Redis look-up, score",
                                 buckets=(.0002, .0005, .001, .002, .005, .01, .025, .05, .1), registry=registry)
        self.routed = Counter("decodelab_routed_requests", "Requests by routing reason (prefix, load, affinity, "
                              "shared)", ["reason"], registry=registry)
        self.cached = Counter("decodelab_routed_cached_tokens", "Prompt tokens the chosen replica held, per its KV "
                              "events", registry=registry)

    def observe(self, route) -> None:
        reason = route.reason if route is not None else "shared"
        self.routed.labels(reason).inc()
        if route is not None:
            self.seconds.observe(route.seconds)
            self.cached.inc(route.cached_tokens)


class EngineCollector:
    """Engine and queue gauges of the replica whose ReplicaState `get_state()` returns (None until the model is
    loaded). It reads the state's `stats`, `jobs` and `queue_length` (typed loosely: state.py imports this module)."""

    def __init__(self, get_state: Callable[[], object | None]):
        self.get_state = get_state

    def collect(self):
        state = self.get_state()
        if state is None:
            return
        st = state.stats
        blocks = GaugeMetricFamily("decodelab_kv_blocks", "KV cache blocks by state", labels=["state"])
        for name in ("total", "used", "shared", "cached", "free"):
            blocks.add_metric([name], getattr(st, f"blocks_{name}"))
        yield blocks
        queries, hits = st.prefix_queries, st.prefix_hits
        yield CounterMetricFamily("decodelab_prefix_cache_queries", "Prefix-cache block lookups", value=queries)
        yield CounterMetricFamily("decodelab_prefix_cache_hits", "Prefix-cache block hits", value=hits)
        yield GaugeMetricFamily("decodelab_prefix_cache_hit_rate", "hits / queries",
                                value=hits / queries if queries else 0)
        yield CounterMetricFamily("decodelab_preemptions", "Sequences preempted", value=st.preemptions)
        yield CounterMetricFamily("decodelab_cow_copies", "Copy-on-write block copies", value=st.cow_copies)
        proposed, accepted = st.spec_proposed, st.spec_accepted
        if proposed:
            yield CounterMetricFamily("decodelab_spec_proposed_tokens", "Draft tokens proposed", value=proposed)
            yield CounterMetricFamily("decodelab_spec_accepted_tokens", "Draft tokens accepted", value=accepted)
            yield GaugeMetricFamily("decodelab_spec_acceptance_rate", "accepted / proposed",
                                    value=accepted / proposed if proposed else 0)
        yield GaugeMetricFamily("decodelab_num_running", "Sequences running in the batch",
                                value=st.num_running)
        yield GaugeMetricFamily("decodelab_num_waiting", "Requests waiting inside the engine",
                                value=st.num_waiting)
        yield GaugeMetricFamily("decodelab_replica_requests", "Requests held by this replica", value=len(state.jobs))
        yield GaugeMetricFamily("decodelab_queue_length", "Requests waiting in the Redis stream for any replica",
                                value=state.queue_length)
