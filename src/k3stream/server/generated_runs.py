"""The token ids of the texts the model wrote in tokens of its own.

A model may write a text in other tokens than the tokenizer gives it (`_` `t` `ime` where the tokenizer
has `_time`): sampling, and a grammar that lets through a prefix shared by two names, pick any token. An
agent sends the answer back as text in the next turn's history; tokenized again it is other ids than
the ones the answer's state holds, so the prompt cache's match (exact token ids) would end at the first
such token and the turn would prefill the rest of the answer again. `ServedModel.encode_chat` writes a
text between two special tokens in the ids the model wrote it in where the ids before it are the ones
the model wrote it after: the model reads its answer as it wrote it, as in one continuing conversation
(`k3stream chat`). Keyed by those ids (their digest), an answer changes no other conversation's prompt.
The records live in RAM; a restarted server (`--cache-dir`) and a restored slot rebuild them from the
token ids of the states they hold (`recall`).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import xxhash

from k3stream.engine.tokenizer import Tokenizer

# characters of texts and tokens of their ids kept; the least recently used go first
GENERATED_RUN_SIZE = 8 << 20


class PrefixDigest:
    """An xxh3_64 of a growing list of token ids, read at any length it reached."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()
        self._length = 0

    def at(self, ids: Sequence[int]) -> int:
        """The digest of `ids`, which extend the ids read before."""
        self._hash.update(array("q", ids[self._length :]).tobytes())
        self._length = len(ids)
        return self._hash.intdigest()


class GeneratedRuns:
    """Texts the model wrote between special tokens (or an answer's ends) whose ids are not the
    tokenizer's, with those ids, by the digest of the ids before them; the least recently used go first
    once they exceed `max_size`."""

    def __init__(self, tokenizer: Tokenizer, max_size: int = GENERATED_RUN_SIZE) -> None:
        self.tokenizer = tokenizer
        self.max_size = max_size
        self._special = frozenset(tokenizer.special_tokens.values())
        self._runs: OrderedDict[tuple[int, str], tuple[int, ...]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()  # the scheduler's thread adds answers, the tokenizer threads read

    def remember(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Keep the runs of `answer`'s ids between its special tokens that the tokenizer writes in other
        ids, after `prompt` and the answer before them; a run whose bytes are no whole UTF-8 text (an
        answer cut inside a character) or that spells special-token text is not kept: no text sent back
        can stand for it."""
        written, digest = list(prompt), PrefixDigest()
        for start, run in _runs_between(answer, self._special):
            try:
                text = self.tokenizer.decode_bytes(run).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if (
                self.tokenizer.special_split(text) == [text]
                and tuple(self.tokenizer.encode_plain(text)) != run
            ):
                written += answer[len(written) - len(prompt) : start]
                self._keep((digest.at(written), text), run)

    def recall(self, held: Iterable[Sequence[int]]) -> None:
        """Keep the runs `remember` keeps of the answers within `held`, the token ids of the states a
        restarted prompt cache found on disk (the records themselves live in RAM only). A text between
        special tokens there whose ids are not the tokenizer's is one the model wrote (a prompt's texts
        are the tokenizer's ids, an answer sent back the model's), so each list is read whole, as an
        answer after no prompt; a list that begins another is read within that one."""
        ordered = sorted(map(tuple, held))
        for index, ids in enumerate(ordered):
            if index + 1 == len(ordered) or ordered[index + 1][: len(ids)] != ids:
                self.remember((), ids)

    def ids(self, before: int, text: str) -> tuple[int, ...] | None:
        """The ids the model wrote `text` in after the ids of digest `before`, where they are not the
        tokenizer's; else None."""
        with self._lock:
            run = self._runs.get((before, text))
            if run is not None:
                self._runs.move_to_end((before, text))
        return run

    def _keep(self, key: tuple[int, str], run: tuple[int, ...]) -> None:
        size = len(key[1]) + len(run)
        with self._lock:
            old = self._runs.pop(key, None)
            self._size -= 0 if old is None else len(key[1]) + len(old)
            if size > self.max_size:
                return
            self._runs[key] = run
            self._size += size
            while self._size > self.max_size:
                (_, dropped), ids = self._runs.popitem(last=False)
                self._size -= len(dropped) + len(ids)


def _runs_between(ids: Sequence[int], special: frozenset[int]) -> Iterator[tuple[int, tuple[int, ...]]]:
    """The runs of `ids` between the `special` ones (empty ones left out), each with where it starts."""
    start = 0
    for index, token in enumerate([*ids, None]):
        if token is None or token in special:
            if index > start:
                yield start, tuple(ids[start:index])
            start = index + 1
