"""The tiny models' tokenizer: merges learned from a small embedded English + code + unicode corpus,
stored as `gguf.vocab.Vocab` (bytes, merges, Kimi's special tokens)."""

from __future__ import annotations

import functools
from collections import Counter
from itertools import pairwise

import regex

from k3stream.gguf.vocab import Vocab, vocab_from_learned

N_MERGES = 320

# Kimi's pre-tokenizer pattern (tiktoken pat_str), without the Han-exclusion set operations; used here
# only to cut the training corpus into words.
PRETOKENIZE = regex.compile(
    r"\p{Han}+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Once upon a time there was a small model that could only speak a few words, but it tried its best.
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in
want of a wife. However little known the feelings or views of such a man may be on his first entering
a neighbourhood, this truth is so well fixed in the minds of the surrounding families.
We stream the routed experts from an expert pack on disk, keep the hot ones in memory, and prefetch
the next layer's experts while the current layer computes. The cache hit rate is what makes it fast.
Hello, world! How are you today? I'm fine, thanks. Let's write some code and then test it again.
Please answer the question: what is the capital of France? The capital of France is Paris.
In 2025 the model had 93 layers, 896 experts per layer and 16 experts active for every token.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Expert:
    def __init__(self, layer, index):
        self.layer = layer
        self.index = index

    def __repr__(self):
        return f"Expert(layer={self.layer}, index={self.index})"


for i in range(10):
    print(i, fibonacci(i))

import numpy as np
x = np.zeros((4, 4), dtype=np.float32)
result = {"name": "kimi", "layers": 93, "experts": [1, 2, 3]}

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 10; ++i) {
        printf("%d\\n", i);
    }
    return 0;
}

function add(a, b) { return a + b; }
const values = [1, 2, 3].map((v) => v * 2);

Ünïcödé tëxt: café, naïve, résumé, Straße, Ελληνικά, русский язык, 日本語の文章, 中文文本测试, 한국어 문장.
Emoji: 🙂 🚀 ✨ — “quotes” and ‘apostrophes’ … done.
你好，世界！今天天气很好。我们一起学习人工智能和机器学习。
"""


def _word_counts() -> Counter[tuple[bytes, ...]]:
    words = Counter(PRETOKENIZE.findall(CORPUS))
    return Counter({tuple(bytes([b]) for b in w.encode()): n for w, n in words.items()})


def _most_frequent_pair(words: Counter[tuple[bytes, ...]], known: set[bytes]) -> tuple[bytes, bytes] | None:
    pairs: Counter[tuple[bytes, bytes]] = Counter()
    for word, count in words.items():
        for left, right in pairwise(word):
            if left + right not in known:
                pairs[(left, right)] += count
    if not pairs:
        return None
    # ties break on the byte strings, so training is deterministic
    return max(pairs.items(), key=lambda item: (item[1], item[0]))[0]


def _apply_merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    merged: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def learn_tokens(n_merges: int = N_MERGES) -> list[bytes]:
    """The byte strings of the learned merges, in the order they were learned."""
    words = _word_counts()
    known = {bytes([b]) for b in range(256)}
    learned: list[bytes] = []
    while len(learned) < n_merges:
        pair = _most_frequent_pair(words, known)
        if pair is None:
            break
        learned.append(pair[0] + pair[1])
        known.add(learned[-1])
        words = Counter({_apply_merge(w, pair): n for w, n in words.items()})
    return learned


@functools.lru_cache(maxsize=1)
def tiny_vocab() -> Vocab:
    """The built-in vocabulary: bytes, learned merges, then the special tokens (CONTROL)."""
    return vocab_from_learned(learn_tokens())
