"""The arguments of the tool calls this server generated, as the model wrote them.

An agent sends each call back in the next turn's history, often re-serialised: an Anthropic `tool_use`
block's `input` is an object, which `/v1/messages` writes as compact JSON, and LangChain and other
clients parse a chat call's `arguments` and dump them again. The chat template would then write other
text than the model wrote, and the prompt cache's match (exact token ids) would end at that call, so the
turn would prefill its whole history from there. `ServedModel.prepare_chat` writes a call's arguments as
the model wrote them wherever its id is one this server gave and its arguments are the same JSON value;
any other arguments are written as the client sent them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

# characters of call ids, arguments and their values' keys kept; the least recently used go first
GENERATED_CALL_CHARS = 8 << 20


class GeneratedCalls:
    """The arguments text of generated calls by (call id, the arguments' JSON value), least recently used
    first out once they exceed `max_chars` characters. Kimi numbers a conversation's calls
    (`functions.NAME:IDX`), so one id names calls of many conversations: the value tells them apart."""

    def __init__(self, max_chars: int = GENERATED_CALL_CHARS) -> None:
        self.max_chars = max_chars
        self._written: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the scheduler's thread adds calls, the tokenizer threads read them

    def remember(self, call_id: str, written: str) -> None:
        """Keep `written`, the arguments of the call `call_id` as the model wrote them (not JSON: nothing
        kept, as a client sends such text back as it came)."""
        value = value_key(written)
        if value is None:
            return
        key = (call_id, value)
        size = len(call_id) + len(value) + len(written)
        with self._lock:
            if key in self._written:
                self._chars -= _size(key, self._written.pop(key))
            if size > self.max_chars:
                return
            self._written[key] = written
            self._chars += size
            while self._chars > self.max_chars:
                old, text = self._written.popitem(last=False)
                self._chars -= _size(old, text)

    def written(self, call_id: str, arguments: str) -> str:
        """`arguments` as the model wrote them, where this server generated the call `call_id` with
        arguments of the same JSON value; else `arguments` as they are."""
        value = value_key(arguments)
        if value is None:
            return arguments
        with self._lock:
            found = self._written.get((call_id, value))
            if found is not None:
                self._written.move_to_end((call_id, value))
        return arguments if found is None else found


def value_key(text: str) -> str | None:
    """The JSON value of `text` in one spelling (keys sorted, no spaces), None where `text` is not JSON or
    repeats a key in an object (readers disagree on which of its values counts)."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        return None
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key repeats")
    return found


def _size(key: tuple[str, str], written: str) -> int:
    return len(key[0]) + len(key[1]) + len(written)
