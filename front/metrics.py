"""The front's GET /metrics: Prometheus text through prometheus-client.

Measured here, per HTTP request: counts by route and status, the request's duration, time to first token
and time per output token of chat requests. From the handler's `stats` handler (the health probe's last
answer): running and waiting requests, KV cache blocks used and total, prefix-cache hit rate, preemptions,
the handler's resident memory, whether the handler is ready, and speculative decoding's draft tokens verified
and accepted (their ratio is the acceptance rate); with several data-parallel engines, each one's gauges and
draft counts too (label `engine`).
"""
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "nanovllm"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds, from a decode step on a GPU to a long queue.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServingMetrics:
    def __init__(self, engine_stats: Callable[[], dict], handler_ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.duration = Histogram(f"{PREFIX}_request_duration_seconds", "Time from a request's arrival to its "
                                  "last byte, by route", ["route"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Chat requests: time from arrival to the first reply chunk",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Chat requests: time from the first chunk to the last, "
            "per output token after the first", buckets=TPOT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats, handler_ready))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def observe_chat(self, first_chunk_s: float, last_chunk_s: float, completion_tokens: int | None) -> None:
        """Times from the request's arrival; completion_tokens from the last chunk's usage, when it has one."""
        self.time_to_first_token.observe(first_chunk_s)
        if completion_tokens and completion_tokens > 1:
            self.time_per_output_token.observe((last_chunk_s - first_chunk_s) / (completion_tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The handler's own numbers at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict], handler_ready: Callable[[], bool]) -> None:
        self._engine_stats, self._handler_ready = engine_stats, handler_ready

    def collect(self):
        yield GaugeMetricFamily(f"{PREFIX}_worker_ready", "1 while the handler answers its health probes",
                                value=int(self._handler_ready()))
        stats = self._engine_stats()
        gauges = (("running", "num_requests_running", "Requests being generated"),
                  ("waiting", "num_requests_waiting", "Requests queued for the engine"),
                  ("num_total_blocks", "kv_cache_blocks_total", "KV cache blocks in the pool"),
                  ("prefix_cache_hit_rate", "prefix_cache_hit_rate",
                   "Share of prompt tokens found in the prefix cache since start"),
                  ("handler_rss_bytes", "handler_resident_memory_bytes", "The handler process's resident memory"))
        for key, name, documentation in gauges:
            if _is_number(stats.get(key)):
                yield GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=stats[key])
        if _is_number(stats.get("num_total_blocks")) and _is_number(stats.get("num_free_blocks")):
            yield GaugeMetricFamily(f"{PREFIX}_kv_cache_blocks_used", "KV cache blocks holding tokens",
                                    value=stats["num_total_blocks"] - stats["num_free_blocks"])
        for key, name, documentation in COUNTERS:
            if _is_number(stats.get(key)):
                yield CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=stats[key])
        engines = stats.get("engines")
        if isinstance(engines, list) and engines:
            engines = [e if isinstance(e, dict) else {} for e in engines]
            yield from _per_engine(gauges, engines, GaugeMetricFamily)
            yield from _per_engine(COUNTERS, engines, CounterMetricFamily)


# The engine's counters since start: (stats key, metric name, documentation).
COUNTERS = (("num_preemptions", "preemptions", "Requests preempted for lack of KV cache blocks"),
            ("spec_drafted_tokens", "spec_draft_tokens", "Speculative decoding: draft tokens verified"),
            ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative decoding: draft tokens accepted"))


def _per_engine(metrics, engines: list[dict], family_type):
    """With data parallelism (HFENDPOINT_DATA_PARALLEL_SIZE), each engine's own gauges or counters, labelled by
    its index."""
    for key, name, documentation in metrics:
        family = family_type(f"{PREFIX}_engine_{name}", f"{documentation}, per data-parallel engine",
                             labels=["engine"])
        for index, stats in enumerate(engines):
            if _is_number(stats.get(key)):
                family.add_metric([str(index)], stats[key])
        yield family


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
