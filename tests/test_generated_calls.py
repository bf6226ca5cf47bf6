"""The memory of generated tool calls' arguments: a call sent back with the same JSON value is written as
the model wrote it, anything else as the client sent it, in bounded memory."""

from __future__ import annotations

import json

from k3stream.server.generated_calls import GeneratedCalls, value_key

WRITTEN = '{"city": "Paris", "days": 2, "tags": ["a", {"b": null}]}'
VALUE = json.loads(WRITTEN)
COMPACT = json.dumps(VALUE, separators=(",", ":"))


def test_the_same_value_is_written_as_the_model_wrote_it():
    calls = GeneratedCalls()
    calls.remember("functions.get_weather:0", WRITTEN)
    for sent in (
        COMPACT,  # /v1/messages' input
        json.dumps(dict(reversed(VALUE.items())), indent=2),  # keys reordered, indented
        WRITTEN,
    ):
        assert calls.written("functions.get_weather:0", sent) == WRITTEN


def test_anything_else_is_written_as_sent():
    calls = GeneratedCalls()
    calls.remember("functions.get_weather:0", WRITTEN)
    changed = json.dumps({**VALUE, "days": 3})
    as_float = json.dumps({**VALUE, "days": 2.0})  # equal in Python, another JSON number
    for call_id, sent in (
        ("functions.get_weather:0", changed),
        ("functions.get_weather:0", as_float),
        ("functions.get_weather:1", COMPACT),  # another call of the same value
        ("functions.get_weather:0", '{"city": "Paris", "days": 2, "tags": ["a", {"b": null}]'),  # not JSON
    ):
        assert calls.written(call_id, sent) == sent


def test_text_that_repeats_a_key_or_is_not_json_is_not_kept():
    calls = GeneratedCalls()
    calls.remember("a", '{"x": 1, "x": 2}')
    calls.remember("b", '{"x": 1')
    assert calls.written("a", '{"x":2}') == '{"x":2}'
    assert value_key('{"x": 1, "x": 2}') is None and value_key('{"x": 1') is None


def test_memory_is_bounded_and_the_least_recently_used_go_first():
    entry = len("call-0") + len(value_key(WRITTEN)) + len(WRITTEN)
    calls = GeneratedCalls(max_chars=3 * entry)
    for number in range(3):
        calls.remember(f"call-{number}", WRITTEN)
    assert calls.written("call-0", COMPACT) == WRITTEN  # used: now the most recent
    calls.remember("call-3", WRITTEN)
    kept = {number: calls.written(f"call-{number}", COMPACT) == WRITTEN for number in range(4)}
    assert kept == {0: True, 1: False, 2: True, 3: True}
    calls.remember("huge", json.dumps({"text": "x" * 4 * entry}))  # larger than the memory: not kept
    assert calls.written("call-3", COMPACT) == WRITTEN
