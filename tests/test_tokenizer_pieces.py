"""The pre-tokenizer's pieces against llama.cpp's `kimi-k2` split, on a vocabulary that shows them.

The tiny models' vocabulary has few merges, so most texts give the same tokens however they are cut
into pieces. Here every character of ALPHABET is one token and every pair of them another: a piece
boundary that llama.cpp does not make (or one it makes that we do not) changes the tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import requires_llama
from k3stream.engine.tokenizer import Tokenizer
from test_tokenizer import SPECIALS, _llama_ids

# one or more characters of each kind the split tells apart
ALPHABET = [
    *"aeoszHWT'dlmrvE",  # letters of both cases, the contractions' letters, the apostrophe
    "ǅ", "ʰ", "ก", "ß", "Ω", "é",  # title case, modifier, other letters
    "\u0301", "\u0e48", "\u093f", "\u064e", "\u20dd",  # combining marks (Mn, Mc, Me)
    "न", "한", "ع",  # letters of scripts written with marks
    "中", "文", "々", "〇", "⺀", "\uf900",  # Han ideographs, and Han-script characters that are not
    *"19", "١", "²", "Ⅻ", "𝟘",  # digits and other numbers
    *"!.(<$", "—", "…",  # punctuation and symbols
    " ", "\t", "\n", "\r", "\x0b", "\x85", "\u00a0", "\u3000", "\u2028",  # whitespace
    "\x00", "\x1c", "\u200d", "\ufe0f", "🙂", "🏽", "🇫",  # controls, joiners, emoji
    "\u1c89", "\U00010d40", "\U000323b0",  # a letter, a digit, an ideograph of Unicode 16 and 17
    "\U0002b73a", "\U0002cea2",  # ideographs Unicode 17 put inside blocks llama.cpp takes as Han
]  # fmt: skip


def pair_vocab():
    """Bytes, each character of ALPHABET as one token (with the tokens of its leading bytes, so that
    it merges), then each pair of characters as a token."""
    from k3stream.gguf.vocab import vocab_from_learned

    learned: list[bytes] = []

    def add(token: bytes) -> None:
        if len(token) > 1 and token not in learned:
            learned.append(token)

    for char in ALPHABET:
        spelled = char.encode()
        for end in range(2, len(spelled) + 1):
            add(spelled[:end])
    for left in ALPHABET:
        for right in ALPHABET:
            add((left + right).encode())
    return vocab_from_learned(learned)


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory):
    from k3stream.testing.tiny import TinySpec, make_tiny

    vocab = pair_vocab()
    return make_tiny(tmp_path_factory.mktemp("pairs"), TinySpec(vocab=len(vocab.tokens)), vocab=vocab)


@pytest.fixture(scope="module")
def pairs(pairs_path):
    import llama_cpp

    llama = llama_cpp.Llama(str(pairs_path), vocab_only=True, verbose=False)
    yield Tokenizer.from_gguf(pairs_path), llama
    llama.close()


# where tokenization_kimi.py's regex (case-split words, marks inside words, the whole Han script) and
# llama.cpp's split differ
SPLIT_APART = [
    "HelloWorld",
    "a\u1c89's",
    "1\U00010d4099",
    "madWard",
    "a\u0301sé",
    "न\u093fन",
    "ก\u0e48ก",
    "ع\u064eع",
    "中々〇文",
    "a\u0301's",
    "\u20ddrE",
    "'\U0002b73a's",
    "!\U0002cea2\U0002cea2a",
]


@requires_llama
@pytest.mark.parametrize("text", SPLIT_APART)
def test_pieces_are_llama_cpps_where_kimis_regex_cuts_otherwise(pairs, text):
    tokenizer, llama = pairs
    assert tokenizer.encode(text, add_bos=False) == _llama_ids(llama, text, special=False)


@requires_llama
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(ALPHABET + SPECIALS), max_size=24).map("".join), special=st.booleans())
def test_random_text_has_llama_cpps_pieces(pairs, text, special):
    tokenizer, llama = pairs
    assert tokenizer.encode(text, allow_special=special, add_bos=False) == _llama_ids(llama, text, special)


@requires_llama
def test_a_mark_before_a_contraction_on_the_tiny_vocabulary(tokenizer, model_path):
    """Even the tiny models' few merges show it: a lone combining mark then `'s` was one piece (the mark
    a letter of the word), `'s` one token; llama.cpp cuts before `'`."""
    import llama_cpp

    llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    for text in ("\u0650's", "\u0901's"):
        assert tokenizer.encode(text, add_bos=False) == _llama_ids(llama, text, special=False)
    llama.close()


# each code point in these places: alone, between letters, doubled, before a digit and a space, after an
# apostrophe and before a contraction, after a mark and after a line break (where the split's rules meet)
CODE_POINT_PLACES = "xCy CC1 A'C's e\u0301C\nC!"


@requires_llama
@pytest.mark.slow
def test_every_code_point_is_cut_as_llama_cpp_cuts_it(pairs):
    """The split's character classes are llama.cpp's for all of Unicode: the `regex` module's tables
    (a newer Unicode) must not make a letter, number or space of what llama.cpp's do not."""
    tokenizer, llama = pairs
    points = [chr(point) for point in range(0x110000) if not 0xD800 <= point < 0xE000]
    differing = []

    def cut_otherwise(chars: list[str]) -> bool:
        text = "".join(CODE_POINT_PLACES.replace("C", char) for char in chars)
        return tokenizer.encode(text, add_bos=False) != _llama_ids(llama, text, special=False)

    for start in range(0, len(points), 512):
        batch = points[start : start + 512]
        if cut_otherwise(batch):  # which of them, one by one
            differing += [f"U+{ord(char):04X}" for char in batch if cut_otherwise([char])]
    assert not differing, f"{len(differing)} code points cut otherwise, first {differing[:8]}"
