"""bench_stream_timeline's arithmetic: the disk's busy time is the union of the read ranges, each
token phase's idle time and each router's counts come from the events, and a token's busy and idle
time add up to it."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def timeline(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_stream_timeline

    return bench_stream_timeline


def test_the_disk_is_busy_for_the_union_of_its_reads_within_the_window(timeline):
    ranges = [(0.0, 4.0), (2.0, 6.0), (10.0, 12.0), (11.0, 11.5)]  # overlapping, nested, apart
    assert timeline.busy_ms(ranges, 0.0, 20.0) == 8.0
    assert timeline.busy_ms(ranges, 5.0, 11.0) == 2.0  # clipped to the window
    assert timeline.busy_ms(ranges, 6.0, 10.0) == 0.0
    assert timeline.busy_ms([], 0.0, 5.0) == 0.0


def test_each_phase_of_a_token_has_its_time_and_the_disk_idle_in_it(timeline):
    events = [  # (kind, layer, start, end, extra), ms; one MoE layer (1) in a 100 ms token
        ("attn", 1, 30.0, 50.0, None),
        ("route", 1, 52.0, 52.0, (16, 6, 2)),  # asked 16: 6 resident, 2 being read, 8 missing
        ("range", "layer 1 expert 3", 40.0, 60.0, 1),  # a hint's read, then a miss's after the router
        ("range", "layer 1 expert 9", 55.0, 80.0, 2),
        ("queue", 1, 52.0, 53.5, None),  # the router's reads queued 1.5 ms after it
        ("routed", 1, 53.0, 90.0, None),
    ]
    ranges = sorted((e[2], e[3]) for e in events if e[0] == "range")
    phases = timeline.token_phases(events, 0.0, 100.0, ranges)
    assert phases == [
        ("token start -> L1 start", 30.0, 30.0),
        ("L1 start -> L1 router", 22.0, 10.0),
        ("L1 router -> L1 end", 38.0, 10.0),
        ("L1 end -> token end", 10.0, 10.0),
    ]
    [(layer, router, row)] = timeline.step_rows(events, 0.0, 100.0, ranges)
    # the reads started after the router: expert 9's, 3 ms after it; the last lands 28 ms after it
    assert layer == 1 and router and row == (6, 2, 8, 28.0, 1.0, 3.0, 1.5)


def test_the_disk_busy_and_idle_time_of_a_token_add_up_to_the_token(timeline):
    ranges = [(5.0, 15.0), (10.0, 20.0), (110.0, 150.0)]
    busy, idle = timeline.disk_per_token(ranges, [(0.0, 100.0), (100.0, 160.0)])
    assert (busy, idle) == (27.5, 52.5)  # tokens of 100 and 60 ms: busy 15 and 40, idle 85 and 20
