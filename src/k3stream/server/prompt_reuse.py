"""The prompt cache's figures on /metrics: prompt tokens reused and computed, hits, misses, evictions,
and snapshots and bytes per tier (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from k3stream.engine.prompt_cache import PromptCache


def register_cache_metrics(registry: CollectorRegistry, cache: PromptCache | None) -> None:
    """Add the cache's collector to `registry` (nothing without a cache)."""
    if cache is not None:
        registry.register(PromptCacheCollector(cache))


class PromptCacheCollector(Collector):
    def __init__(self, cache: PromptCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cache, stats = self.cache, self.cache.stats
        counters = {
            "k3stream_prompt_tokens_reused": (
                "prompt tokens restored from the prompt cache",
                stats.tokens_reused,
            ),
            "k3stream_prompt_tokens_computed": (
                "prompt tokens prefilled with the cache on",
                stats.tokens_computed,
            ),
            "k3stream_prompt_cache_hits": ("prefills that restored a cached prefix", stats.hits),
            "k3stream_prompt_cache_misses": ("prefills with no cached prefix", stats.misses),
            "k3stream_prompt_cache_snapshots_created": (
                "sequence states snapshotted",
                stats.snapshots_created,
            ),
            "k3stream_prompt_cache_disk_errors": (
                "snapshot files unreadable, corrupt or unwritable",
                stats.disk_errors,
            ),
        }
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(name, text, value=float(value))
        evictions = CounterMetricFamily(
            "k3stream_prompt_cache_evictions", "snapshots evicted", labels=["tier"]
        )
        evictions.add_metric(["ram"], float(stats.evictions_ram))
        evictions.add_metric(["disk"], float(stats.evictions_disk))
        yield evictions
        counts = cache.counts()
        snapshots = GaugeMetricFamily("k3stream_prompt_cache_snapshots", "snapshots held", labels=["tier"])
        held = GaugeMetricFamily("k3stream_prompt_cache_bytes", "bytes of snapshots held", labels=["tier"])
        for tier, nbytes in (("ram", cache.ram_bytes), ("disk", cache.disk_used)):
            snapshots.add_metric([tier], float(counts[f"{tier}_snapshots"]))
            held.add_metric([tier], float(nbytes))
        yield snapshots
        yield held
        if cache.has_disk:
            yield from _directory_metrics(cache)


def _directory_metrics(cache: PromptCache) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The disk tier's directory: bytes of this folder and of the others, and what its trims removed."""
    on_disk = GaugeMetricFamily(
        "k3stream_prompt_cache_dir_bytes",
        "bytes of snapshot files under --cache-dir: this process's folder (own) and the folders of other "
        "builds, arithmetic flags, model files or ranks (foreign)",
        labels=["folder"],
    )
    on_disk.add_metric(["own"], float(cache.disk_used))
    on_disk.add_metric(["foreign"], float(cache.stats.foreign.nbytes))
    yield on_disk
    removed = cache.stats.removed
    entries = CounterMetricFamily(
        "k3stream_prompt_cache_dir_removed",
        "what trimming --cache-dir removed besides this folder's evictions: foreign folders' snapshots, "
        "temporary files of writers that died, emptied foreign folders",
        labels=["kind"],
    )
    freed = CounterMetricFamily(
        "k3stream_prompt_cache_dir_removed_bytes", "bytes trimming --cache-dir removed", labels=["kind"]
    )
    for kind, count, nbytes in (
        ("foreign_snapshot", removed.snapshots, removed.snapshot_bytes),
        ("stale_temporary", removed.temporaries, removed.temporary_bytes),
        ("foreign_folder", removed.folders, 0),
    ):
        entries.add_metric([kind], float(count))
        freed.add_metric([kind], float(nbytes))
    yield entries
    yield freed
