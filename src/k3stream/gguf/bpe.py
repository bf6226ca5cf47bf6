"""GGUF byte-level BPE: the alphabet its vocabularies are written in (GPT-2's reversible map from bytes to
printable unicode characters) and llama.cpp's merge loop over `tokenizer.ggml.merges`.

A word is cut into its bytes (one alphabet character each); the adjacent pair whose merge comes first in
the merge list (the leftmost of equal ones) is joined, until no adjacent pair is a merge. Each symbol left
is the token of that text. The order of the merges decides, not the order of the tokens. The pairs wait
in a heap, as in llama.cpp, so a word of n bytes takes O(n log n) steps, not n^2: a request's text may
hold one word of a million letters.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Mapping, Sequence

WORD_CACHE = 1 << 16  # words whose merged ids are kept: text repeats its words
CACHED_WORD_CHARS = 64  # longer words are merged each time, so the cache holds at most 64 K short words
# a pair waiting to merge: its rank, its left symbol's place, the two texts it joins
Pair = tuple[int, int, str, str]


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def split_merge(merge: str) -> tuple[str, str] | None:
    """The two token texts of one merge entry, split where llama.cpp splits it (the first space after the
    first character); None when it has no such space."""
    space = merge.find(" ", 1)
    return None if space < 0 else (merge[:space], merge[space + 1 :])


class MergeBPE:
    """llama.cpp's BPE over `merges` (`left right` entries, a pair's rank being its first entry's index);
    `token_ids` maps each token text to its id (the tokenizer refuses a text held twice, as llama.cpp does).

    Every merge must name tokens of the vocabulary, each part and the pair joined: one that does not is
    refused naming `source` and the entry."""

    def __init__(self, merges: Sequence[str], token_ids: Mapping[str, int], source: str) -> None:
        self._ranks: dict[str, int] = {}
        for index, merge in enumerate(merges):
            pair = split_merge(merge)
            if pair is None:
                raise ValueError(
                    f"{source}: tokenizer.ggml.merges entry {index} {merge!r} is not two tokens and a space"
                )
            unknown = next((text for text in (*pair, "".join(pair)) if text not in token_ids), None)
            if unknown is not None:
                raise ValueError(
                    f"{source}: tokenizer.ggml.merges entry {index} {merge!r} names {unknown!r}, "
                    "which is no token of the vocabulary"
                )
            self._ranks.setdefault(merge, index)
        self._token_ids = token_ids
        self._byte_text = byte_to_unicode()
        self._cached_word_ids = functools.lru_cache(maxsize=WORD_CACHE)(self._merge_word)

    def word_ids(self, word: str) -> tuple[int, ...]:
        """The ids of one pre-tokenized piece of text."""
        if len(word) <= CACHED_WORD_CHARS:
            return self._cached_word_ids(word)
        return self._merge_word(word)

    def _merge_word(self, word: str) -> tuple[int, ...]:
        symbols = [self._byte_text[b] for b in word.encode("utf-8")]
        after = list(range(1, len(symbols))) + [-1]  # the next live symbol of each (-1: none)
        before = list(range(-1, len(symbols) - 1))
        heap: list[Pair] = []
        for left in range(len(symbols) - 1):
            self._push(heap, left, symbols[left], symbols[left + 1])
        while heap:
            _, left, left_text, right_text = heapq.heappop(heap)
            right = after[left]
            if right < 0 or symbols[left] != left_text or symbols[right] != right_text:
                continue  # a pair one of whose symbols has merged since it was pushed
            symbols[left], symbols[right] = left_text + right_text, ""
            after[left] = after[right]
            if after[left] >= 0:
                before[after[left]] = left
                self._push(heap, left, symbols[left], symbols[after[left]])
            if before[left] >= 0:
                self._push(heap, before[left], symbols[before[left]], symbols[left])
        return tuple(self._token_ids[symbol] for symbol in symbols if symbol)

    def _push(self, heap: list[Pair], left: int, left_text: str, right_text: str) -> None:
        """Queue the pair at `left` where it is a merge: the first rank, then the leftmost, pops first."""
        rank = self._ranks.get(f"{left_text} {right_text}")
        if rank is not None:
            heapq.heappush(heap, (rank, left, left_text, right_text))
