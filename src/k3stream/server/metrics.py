"""Prometheus metrics of the server, in a registry of their own (one per app, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    """Counters the HTTP layer and the scheduler update; expert-store figures are read at scrape time."""

    def __init__(self, store_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "k3stream_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("k3stream_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("k3stream_generation_tokens", "tokens generated", registry=r)
        self.shared_prefills = Counter(
            "k3stream_shared_prefills",
            "requests that waited for another request's prefill of their shared prompt prefix",
            registry=r,
        )
        # the same two counts under llama-server's names, which its dashboards read
        self.llama_prompt_tokens = Counter(
            "llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r
        )
        self.llama_predicted = Counter(
            "llamacpp:tokens_predicted", "Number of generation tokens processed.", registry=r
        )
        # llama-server's times (summed over sequences, as it sums its slots'), decode count and throughputs
        self.llama_prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time", registry=r)
        self.llama_predicted_seconds = Counter(
            "llamacpp:tokens_predicted_seconds", "Predict process time", registry=r
        )
        self.llama_decodes = Counter("llamacpp:n_decode", "Total number of llama_decode() calls", registry=r)
        self.llama_prompt_rate = Gauge(
            "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", registry=r
        )
        self.llama_predicted_rate = Gauge(
            "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.", registry=r
        )
        self.llama_tokens_max = Gauge("llamacpp:n_tokens_max", "Largest observed n_tokens.", registry=r)
        self.llama_busy_per_decode = Gauge(
            "llamacpp:n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            registry=r,
        )
        self._tokens_max = 0  # the most tokens one model pass took (a prefill pass or a decode step)
        self._busy_totals = [0, 0]  # sequences over all decode steps, decode steps
        self._prompt_totals = [0, 0.0]  # prompt tokens computed, seconds
        self._predicted_totals = [0, 0.0]  # tokens generated, sequence-seconds of decoding
        self.time_to_first_token = Histogram(
            "k3stream_time_to_first_token_seconds",
            "from request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "k3stream_time_per_output_token_seconds",
            "time between a sequence's successive tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_length = Gauge("k3stream_queue_length", "requests waiting for a batch slot", registry=r)
        self.running = Gauge("k3stream_running_sequences", "sequences in the decode batch", registry=r)
        # the same two figures under llama-server's names, which scripts written for it read
        self.llama_deferred = Gauge("llamacpp:requests_deferred", "Number of requests deferred", registry=r)
        self.llama_processing = Gauge(
            "llamacpp:requests_processing", "Number of requests processing", registry=r
        )
        self.batch_size = Histogram(
            "k3stream_decode_batch_size", "sequences per decode step", buckets=BATCH_BUCKETS, registry=r
        )
        if store_stats is not None:
            r.register(ExpertStoreCollector(store_stats))

    def add_prompt_tokens(self, computed: int, seconds: float) -> None:
        """Prompt tokens prefilled in `seconds` (those restored from the prompt cache are not)."""
        self.prompt_tokens.inc(computed)
        self.llama_prompt_tokens.inc(computed)
        self.llama_prompt_seconds.inc(seconds)
        _add(self._prompt_totals, computed, seconds, self.llama_prompt_rate)
        self._note_pass(computed)

    def add_generated_token(self) -> None:
        self.generation_tokens.inc()
        self.llama_predicted.inc()
        _add(self._predicted_totals, 1, 0.0, self.llama_predicted_rate)

    def add_decode_step(self, sequences: int, seconds: float) -> None:
        """A decode step of `sequences` that took `seconds`: each sequence's decoding time grows by it."""
        self.llama_decodes.inc()
        self.llama_predicted_seconds.inc(seconds * sequences)
        _add(self._predicted_totals, 0, seconds * sequences, self.llama_predicted_rate)
        _add(self._busy_totals, sequences, 1, self.llama_busy_per_decode)
        self._note_pass(sequences)

    def _note_pass(self, tokens: int) -> None:
        """A model pass over `tokens` tokens: llama-server's high-water mark of them."""
        self._tokens_max = max(self._tokens_max, tokens)
        self.llama_tokens_max.set(self._tokens_max)

    def set_waiting(self, waiting: int, waiting_actions: int = 0) -> None:
        """Requests in the queue (no batch slot yet), and slot actions waiting for their slots: llama-server
        counts both as deferred tasks."""
        self.queue_length.set(waiting)
        self.llama_deferred.set(waiting + waiting_actions)

    def set_running(self, running: int) -> None:
        """Sequences in the batch (prefilling or decoding)."""
        self.running.set(running)
        self.llama_processing.set(running)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _add(totals: list[float], tokens: int, seconds: float, rate: Gauge) -> None:
    """Add to `totals` (tokens, seconds) and set `rate` to their quotient."""
    totals[0] += tokens
    totals[1] += seconds
    rate.set(totals[0] / totals[1] if totals[1] > 0 else 0.0)


class ExpertStoreCollector(Collector):
    """Hit rate per tier and read volume, from the expert store's JSON statistics."""

    def __init__(self, store_stats: Callable[[], dict[str, Any]]) -> None:
        self._store_stats = store_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._store_stats()
        hit_rate = GaugeMetricFamily(
            "k3stream_expert_hit_rate", "expert lookups served by a tier", labels=["tier"]
        )
        for tier, counts in stats.get("tiers", {}).items():
            hit_rate.add_metric([tier], float(counts.get("hit_rate", 0.0)))
        yield hit_rate
        yield CounterMetricFamily(
            "k3stream_expert_bytes_read",
            "bytes read from the expert pack",
            value=float(stats.get("pack_read_bytes", 0)),
        )
        yield CounterMetricFamily(
            "k3stream_expert_integrity_errors",
            "expert objects read from the pack whose checksum did not match",
            value=float(stats.get("integrity_errors", 0)),
        )
        yield GaugeMetricFamily(
            "k3stream_expert_bytes_read_per_token",
            "bytes read from the expert pack per token processed",
            value=float(stats.get("bytes_per_token", 0.0)),
        )
