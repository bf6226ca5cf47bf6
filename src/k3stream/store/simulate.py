"""Replay a routing trace against eviction policies and Belady's offline optimum.

    python -m k3stream.store.simulate TRACE --object-bytes N --sizes 64,256,1024 [--policies lru,...]

Sizes are cache budgets in MiB; a cache holds floor(size / object_bytes) whole objects. Every step
must fit at once (its experts are pinned while they load), so a size below the largest step is
skipped. A hit is a requested (layer, expert) found resident; repeats within a step count once.
Belady here is MIN with forced admission: on a miss, evict the resident key whose next use lies
furthest in the future, never one of the current step; it bounds every online policy from above.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from k3stream.store.cache import SlotCache
from k3stream.store.policies import POLICIES
from k3stream.store.traces import Step, read_trace

MIB = 1 << 20


@dataclass(frozen=True)
class HitCount:
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _step_keys(step: Step) -> list[tuple[int, int]]:
    layer, experts = step
    return [(layer, expert) for expert in dict.fromkeys(experts)]


def largest_step(steps: Sequence[Step]) -> int:
    return max((len(set(experts)) for _, experts in steps), default=0)


def simulate_policy(steps: Sequence[Step], policy: str, capacity: int) -> HitCount:
    """Hits and misses of `policy` with `capacity` objects, making the store's decisions."""
    cache = SlotCache(capacity, policy, sorted({layer for layer, _ in steps}))
    hits = misses = 0
    for step in steps:
        keys = _step_keys(step)
        pinned = set(keys)
        missing = [key for key in keys if not cache.lookup(key)]
        hits += len(keys) - len(missing)
        misses += len(missing)
        for key in missing:
            cache.reserve(key, pinned)
            cache.admit(key)
    return HitCount(hits, misses)


def _next_uses(keyed: list[list[tuple[int, int]]]) -> list[list[int]]:
    never = len(keyed) + 1
    following: dict[tuple[int, int], int] = {}
    next_uses: list[list[int]] = [[] for _ in keyed]
    for index in range(len(keyed) - 1, -1, -1):
        next_uses[index] = [following.get(key, never) for key in keyed[index]]
        for key in keyed[index]:
            following[key] = index
    return next_uses


def simulate_belady(steps: Sequence[Step], capacity: int) -> HitCount:
    """Belady's MIN with forced admission and the current step pinned."""
    keyed = [_step_keys(step) for step in steps]
    resident: dict[tuple[int, int], int] = {}
    heap: list[tuple[int, tuple[int, int]]] = []
    hits = misses = 0
    for keys, next_uses in zip(keyed, _next_uses(keyed), strict=False):
        pinned = set(keys)
        missing = [key for key in keys if key not in resident]
        hits += len(keys) - len(missing)
        misses += len(missing)
        for key, next_use in zip(keys, next_uses, strict=False):
            if key in resident:
                resident[key] = next_use
                heapq.heappush(heap, (-next_use, key))
        _evict_furthest(heap, resident, pinned, len(resident) + len(missing) - capacity)
        for key, next_use in zip(keys, next_uses, strict=False):
            if key not in resident:
                resident[key] = next_use
                heapq.heappush(heap, (-next_use, key))
    return HitCount(hits, misses)


def _evict_furthest(heap: list, resident: dict, pinned: set, count: int) -> None:
    kept = []
    while count > 0:
        negative_use, key = heapq.heappop(heap)
        if resident.get(key) != -negative_use:
            continue
        if key in pinned:
            kept.append((negative_use, key))
            continue
        del resident[key]
        count -= 1
    for entry in kept:
        heapq.heappush(heap, entry)


def hit_rate_table(
    steps: Sequence[Step], object_bytes: int, sizes_mib: Sequence[float], policies: Sequence[str]
) -> list[dict]:
    """One row per size: {size_mib, objects, <policy>: hit rate, ..., belady: hit rate}."""
    floor = largest_step(steps)
    rows = []
    for size in sizes_mib:
        capacity = int(size * MIB // object_bytes)
        if capacity < floor:
            continue
        row = {"size_mib": size, "objects": capacity}
        for policy in policies:
            row[policy] = simulate_policy(steps, policy, capacity).hit_rate
        row["belady"] = simulate_belady(steps, capacity).hit_rate
        rows.append(row)
    return rows


def format_table(rows: list[dict], policies: Sequence[str]) -> str:
    columns = ["size_mib", "objects", *policies, "belady"]
    lines = ["  ".join(f"{name:>9}" for name in columns)]
    for row in rows:
        cells = [f"{row['size_mib']:>9g}", f"{row['objects']:>9d}"]
        cells += [f"{100 * row[name]:>8.1f}%" for name in (*policies, "belady")]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _parse_sizes(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated MiB values, got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m k3stream.store.simulate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("trace", help="routing trace (JSON lines) recorded by ExpertStore(record_trace=...)")
    parser.add_argument(
        "--object-bytes",
        type=int,
        default=None,
        help="bytes per expert object (default: the trace header's object_bytes)",
    )
    parser.add_argument(
        "--sizes", type=_parse_sizes, required=True, help="cache sizes in MiB, comma-separated"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy names")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
        object_bytes = args.object_bytes or int(trace.meta.get("object_bytes") or 0)
        if object_bytes <= 0:
            raise ValueError(f"routing trace {args.trace} has no object_bytes; pass --object-bytes")
        policies = [name.strip() for name in args.policies.split(",") if name.strip()]
        for name in policies:
            if name not in POLICIES:
                raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
        rows = hit_rate_table(trace.steps, object_bytes, args.sizes, policies)
    except (OSError, ValueError) as exc:
        print(f"simulate: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"trace {args.trace}: {len(trace.steps)} steps, {trace.tokens} tokens, "
        f"largest step {largest_step(trace.steps)} experts, object {object_bytes} bytes"
    )
    print(f"source: {trace.meta.get('source', 'unknown')}")
    print(format_table(rows, policies))
    skipped = [size for size in args.sizes if int(size * MIB // object_bytes) < largest_step(trace.steps)]
    if skipped:
        print(f"skipped sizes below one step's working set: {', '.join(f'{s:g}' for s in skipped)} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
