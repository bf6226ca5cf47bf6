"""Routing traces: which experts each MoE layer asked for, step by step (JSON lines).

Line 1 is a header `{"format": TRACE_FORMAT, "source": ..., "moe_layers": [...], "num_experts": X,
"top_k": K, "object_bytes": N}`; then one `{"layer": L, "experts": [ids]}` per demand fetch and one
`{"end_token": n}` after each engine step that produced n tokens.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TRACE_FORMAT = "k3stream-routing-trace-v1"

Step = tuple[int, tuple[int, ...]]


@dataclass
class RoutingTrace:
    meta: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    tokens: int = 0


class TraceWriter:
    """Appends steps to `<path>.partial`; `close()` fsyncs and renames it to `path`."""

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._write({"format": TRACE_FORMAT, **meta})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(self, layer: int, experts: list[int]) -> None:
        self._write({"layer": int(layer), "experts": [int(e) for e in experts]})

    def end_token(self, n_tokens: int) -> None:
        self._write({"end_token": int(n_tokens)})

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)


def read_trace(path: str | os.PathLike[str]) -> RoutingTrace:
    """Parse a trace file (gzipped when its name ends in `.gz`); one-line error naming the file and line
    for anything malformed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    if not lines:
        raise ValueError(f"routing trace {path} is empty")
    trace = RoutingTrace(meta=_parse_line(path, 1, lines[0]))
    if trace.meta.get("format") != TRACE_FORMAT:
        raise ValueError(f"routing trace {path} line 1: format is not {TRACE_FORMAT}")
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        record = _parse_line(path, number, line)
        if "end_token" in record:
            trace.tokens += int(record["end_token"])
        elif "layer" in record and isinstance(record.get("experts"), list):
            trace.steps.append((int(record["layer"]), tuple(int(e) for e in record["experts"])))
        else:
            raise ValueError(f"routing trace {path} line {number}: expected 'layer'+'experts' or 'end_token'")
    return trace


def _parse_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"routing trace {path} line {number}: invalid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"routing trace {path} line {number}: expected a JSON object")
    return record


@dataclass(frozen=True)
class SyntheticSpec:
    """A skewed routing model: Zipf popularity per layer, reuse between tokens, topic drift."""

    moe_layers: int = 60
    num_experts: int = 384
    top_k: int = 8
    tokens: int = 400
    zipf_s: float = 0.9
    reuse: float = 0.35
    drift_every: int = 64
    drift_fraction: float = 0.25
    seed: int = 0


def synthetic_trace(spec: SyntheticSpec) -> RoutingTrace:
    """A synthetic decode trace (one token per step) drawn from `spec`; not from any real model."""
    rng = np.random.default_rng(spec.seed)
    weights = 1.0 / np.arange(1, spec.num_experts + 1) ** spec.zipf_s
    weights /= weights.sum()
    ranking = [rng.permutation(spec.num_experts) for _ in range(spec.moe_layers)]
    previous: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * spec.moe_layers
    trace = RoutingTrace(
        meta={
            "format": TRACE_FORMAT,
            "source": f"synthetic {spec}",
            "moe_layers": list(range(spec.moe_layers)),
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
        }
    )
    for token in range(spec.tokens):
        if token and token % spec.drift_every == 0:
            ranking = [_drift(rng, order, spec.drift_fraction) for order in ranking]
        for layer in range(spec.moe_layers):
            chosen = _route_one(rng, spec, weights, ranking[layer], previous[layer])
            previous[layer] = chosen
            trace.steps.append((layer, tuple(sorted(int(e) for e in chosen))))
        trace.tokens += 1
    return trace


def _drift(rng: np.random.Generator, order: np.ndarray, fraction: float) -> np.ndarray:
    """A topic shift: a random `fraction` of popularity ranks trade places."""
    moved = rng.choice(order.size, size=int(order.size * fraction), replace=False)
    order = order.copy()
    order[moved] = order[rng.permutation(moved)]
    return order


def _route_one(
    rng: np.random.Generator,
    spec: SyntheticSpec,
    weights: np.ndarray,
    order: np.ndarray,
    previous: np.ndarray,
) -> np.ndarray:
    kept = previous[rng.random(previous.size) < spec.reuse]
    probabilities = np.zeros(spec.num_experts)
    probabilities[order] = weights
    probabilities[kept] = 0.0
    probabilities /= probabilities.sum()
    fresh = rng.choice(spec.num_experts, size=spec.top_k - kept.size, replace=False, p=probabilities)
    return np.concatenate([kept, fresh])
