"""The memory of answers the model wrote in tokens of its own: a text between special tokens whose ids are
not the tokenizer's is kept with those ids, by the ids before it, nothing else, in bounded memory (tiny
model's tokenizer)."""

from __future__ import annotations

from k3stream.server.generated_runs import GeneratedRuns, PrefixDigest

PROMPT = [1, 2, 3]


def spelled(tokenizer, text: str) -> list[int]:
    """`text` one character's tokens at a time: the ids a model may write where the tokenizer merges."""
    return [token for character in text for token in tokenizer.encode_plain(character)]


def merged_word(tokenizer) -> str:
    """A word the tokenizer writes in fewer tokens than its characters."""
    word = next(
        (w for w in ("the", " the", "ing", " and", "er", "in") if len(tokenizer.encode_plain(w)) < len(w)),
        None,
    )
    assert word is not None, "the tokenizer merges none of the words tried"
    return word


def digest(ids: list[int]) -> int:
    return PrefixDigest().at(ids)


def test_a_text_written_in_ids_of_its_own_is_kept_after_the_ids_before_it(tokenizer):
    word = merged_word(tokenizer)
    end = next(iter(tokenizer.special_tokens.values()))
    runs = GeneratedRuns(tokenizer)
    ids, plain = spelled(tokenizer, word), tokenizer.encode_plain("plain text")
    runs.remember(PROMPT, [*plain, end, *ids, end])
    assert runs.ids(digest([*PROMPT, *plain, end]), word) == tuple(ids)
    assert runs.ids(digest([*PROMPT, 9, *plain, end]), word) is None  # another conversation
    assert runs.ids(digest(PROMPT), "plain text") is None  # the tokenizer's own ids: nothing to keep


def test_a_cut_character_or_special_token_text_is_not_kept(tokenizer):
    """No text sent back stands for the first byte of a two-byte character (it comes back as U+FFFD), and
    a text that spells a special token is refused or written with that token."""
    first_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.piece(i) == "é".encode()[:1])
    runs = GeneratedRuns(tokenizer)
    runs.remember(PROMPT, [*spelled(tokenizer, "caf"), first_byte])
    runs.remember(PROMPT, spelled(tokenizer, next(iter(tokenizer.special_tokens))))
    assert runs._runs == {}


def test_the_least_recently_used_go_first_past_the_bound(tokenizer):
    word = merged_word(tokenizer)
    others = [f"{word}{index}" for index in range(3)]
    size = len(others[0]) + len(spelled(tokenizer, others[0]))
    runs = GeneratedRuns(tokenizer, max_size=2 * size)
    for text in others[:2]:
        runs.remember(PROMPT, spelled(tokenizer, text))
    assert runs.ids(digest(PROMPT), others[0]) is not None  # now the most recently used
    runs.remember(PROMPT, spelled(tokenizer, others[2]))
    assert [runs.ids(digest(PROMPT), text) is not None for text in others] == [True, False, True]
