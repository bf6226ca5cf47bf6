"""What the fuzz tests share: hypothesis settings that draw the same examples on every run (CI stays
stable), without a deadline (some examples write and load a model), and the small model they run."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

SMALL = dict(n_layers=3, n_experts=4, top_k=2)


def fuzz_settings(max_examples: int) -> settings:
    """Settings for a fuzz test of `max_examples` examples."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
