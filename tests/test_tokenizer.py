"""The GGUF tokenizer against llama.cpp's on the tiny models' Kimi-style vocabulary."""

from __future__ import annotations

import re

import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import requires_llama
from k3stream.cli import main
from k3stream.engine.tokenizer import Tokenizer, VocabFields
from test_gguf import rewrite

VARIED = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "HelloWorld camelCaseWord WORDword ABCdef",
    "I'm fine, they'RE here, we'll see, you'd, it's, SHE'S, don't",
    "café naïve résumé Straße ÀÉÎÕÜ",
    "e\u0301t\u00e9 a\u0300\u0301b",  # combining marks
    "中文文本测试 你好，世界！ 我们一起学习人工智能",
    "日本語の文章 한국어 문장 Ελληνικά русский язык",
    "Emoji: 🙂 🚀 ✨ 👩‍👩‍👧 🇫🇷",
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 ٣٤٥ ①②③",
    "  two  spaces   three    four\t\ttab\n\nnewlines\r\nwindows\n \n  \n",
    "   ",
    "\n",
    " \t\u00a0\u3000 unusual spaces",
    "!!! ??? ... --- *** ### $$$ %%% (()) [[]] {{}} <<>> ||| ~~~ ``` '''",
    "“quotes” ‘apostrophes’ … — – «»",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + n\n",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }',
    "x\u200by zero\u200dwidth \ufeffbom",
    "<|im_end|>",
    "[BOS]Hello<|im_user|>user<|im_middle|>hi<|im_end|>[EOS]",
    "<|im_end |> <|im_end> [BOS [EOS]]",
    "",
]

SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]


@pytest.fixture(scope="module")
def llama_vocab(model_path):
    import llama_cpp

    return llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)


def _llama_ids(llama_vocab, text: str, special: bool) -> list[int]:
    return list(llama_vocab.tokenize(text.encode(), add_bos=False, special=special)) if text else []


def _llama_detokenize(llama_vocab, ids: list[int], special: bool) -> bytes:
    """llama.cpp's detokenizer (the C API: `Llama.detokenize` cuts pieces at 32 bytes)."""
    import ctypes

    import llama_cpp

    size = 64 * len(ids) + 1
    buffer = ctypes.create_string_buffer(size)
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    n = llama_cpp.llama_detokenize(llama_vocab._model.vocab, tokens, len(ids), buffer, size, False, special)
    assert 0 <= n <= size
    return buffer.raw[:n]


@requires_llama
@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", VARIED)
def test_encode_matches_llama_cpp(tokenizer, llama_vocab, text, special):
    assert tokenizer.encode(text, allow_special=special, add_bos=False) == _llama_ids(
        llama_vocab, text, special
    )


@requires_llama
def test_special_token_ids_match_llama_cpp(tokenizer, llama_vocab):
    assert tokenizer.bos_id == llama_vocab.token_bos()
    assert tokenizer.eos_id == llama_vocab.token_eos()
    assert tokenizer.vocab_size == llama_vocab.n_vocab()
    for text in SPECIALS:
        assert [tokenizer.token_id(text)] == _llama_ids(llama_vocab, text, special=True)


# Text drawn from every unicode category plus the characters the vocabulary knows best, so that both
# long merges and unknown characters are exercised.
_KNOWN = st.sampled_from(list("the quick brown fox 123 4567 \n\n\t  def (x): return café 中文测试 🙂 'S'll"))
_TEXT = st.lists(
    st.one_of(_KNOWN, st.characters(exclude_categories=("Cs",)), st.sampled_from(SPECIALS)), max_size=40
).map("".join)


@requires_llama
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT, special=st.booleans())
def test_random_text_matches_llama_cpp(tokenizer, llama_vocab, text, special):
    assert tokenizer.encode(text, allow_special=special) == _llama_ids(llama_vocab, text, special)


@requires_llama
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_matches_llama_cpp(tokenizer, llama_vocab, data):
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    assert tokenizer.decode_bytes(ids) == _llama_detokenize(llama_vocab, ids, special=True)
    assert tokenizer.decode_bytes(ids, skip_special=True) == _llama_detokenize(
        llama_vocab, ids, special=False
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_round_trip_and_streaming(tokenizer, text):
    ids = tokenizer.encode(text, allow_special=True)
    assert tokenizer.decode(ids) == text
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed(token) for token in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text


def test_streaming_holds_back_split_utf8(tokenizer):
    # an emoji is four bytes; the tiny vocabulary spells it with several tokens
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    decoder = tokenizer.stream_decoder()
    assert [decoder.feed(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.feed(ids[-1]) == "🙂"


def test_incomplete_utf8_at_the_end_becomes_replacement(tokenizer):
    ids = tokenizer.encode("🙂")[:-1]
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.feed(token) for token in ids) + decoder.flush() == "\ufffd"
    assert tokenizer.decode(ids) == "\ufffd"


def test_special_text_is_plain_text_unless_allowed(tokenizer):
    im_end = tokenizer.token_id("<|im_end|>")
    assert tokenizer.encode("<|im_end|>", allow_special=True) == [im_end]
    assert im_end not in tokenizer.encode("<|im_end|>", allow_special=False)
    assert tokenizer.decode(tokenizer.encode("a<|im_end|>b", allow_special=True), skip_special=True) == "ab"


def test_add_bos(tokenizer):
    assert tokenizer.encode("hi", add_bos=True)[0] == tokenizer.bos_id
    assert tokenizer.encode("hi", add_bos=None) == tokenizer.encode("hi", add_bos=False)  # file says no


def test_unknown_special_token_and_bad_id_are_refused(tokenizer):
    with pytest.raises(ValueError, match=r"no special token '<\|nope\|>'"):
        tokenizer.token_id("<|nope|>")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def _with(model_path, key: str, value: object):
    """`_read_fields` of the model's GGUF with metadata `key` set to `value`, as file "m.gguf"."""
    from k3stream.engine.tokenizer import _read_fields
    from k3stream.gguf.reader import K3Checkpoint

    checkpoint = K3Checkpoint.open(model_path)

    def metadata(name: str, default: object) -> object:
        return value if name == key else checkpoint.metadata(name, default)

    return _read_fields(metadata, "m.gguf")


@pytest.mark.parametrize(
    ("key", "value"), [("tokenizer.ggml.bos_token_id", 99999), ("tokenizer.ggml.eos_token_id", -1)]
)
def test_special_token_ids_outside_the_vocabulary_are_dropped_with_a_warning_naming_the_key(
    model_path, key, value, caplog
):
    """As llama.cpp ("bad special token"): the file runs without that id; an out-of-range BOS failed
    the first prompt with 'token id outside 0..V-1', an EOS made every grammar-constrained request fail."""
    with caplog.at_level("WARNING"):
        fields = _with(model_path, key, value)
    assert (fields.bos_id if "bos" in key else fields.eos_id) is None
    assert f"m.gguf: {key} is {value}, not a token id of the" in caplog.text
    tokenizer = Tokenizer(fields)
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"


def test_a_special_token_id_that_is_not_an_integer_is_refused_naming_the_key(model_path):
    with pytest.raises(ValueError, match="^m.gguf: tokenizer.ggml.bos_token_id is '1', not a token id$"):
        Tokenizer(_with(model_path, "tokenizer.ggml.bos_token_id", "1"))


def _fields(tokenizer_fields: VocabFields, **changes) -> VocabFields:
    return VocabFields(**{**tokenizer_fields.__dict__, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pre": "llama-bpe"}, "tokenizer.ggml.pre is 'llama-bpe', expected 'kimi-k2'"),
        ({"model": "llama"}, "tokenizer.ggml.model is 'llama', expected 'gpt2'"),
    ],
)
def test_unsupported_vocabularies_are_refused(changes, message):
    base = VocabFields(
        tokens=["a"], token_types=[1], model="gpt2", pre="kimi-k2", bos_id=None, eos_id=None, source="x.gguf"
    )
    with pytest.raises(ValueError, match=f"^x.gguf: {message}"):
        Tokenizer(_fields(base, **changes))


def test_missing_byte_tokens_are_refused():
    fields = VocabFields(
        tokens=["a", "b"],
        token_types=[1, 1],
        model="gpt2",
        pre="kimi-k2",
        bos_id=None,
        eos_id=None,
        source="x.gguf",
    )
    with pytest.raises(ValueError, match="^x.gguf: vocabulary lacks 254 single-byte tokens"):
        Tokenizer(fields)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        # llama.cpp refuses a flag of another type; read as bool() the string "false" would add BOS
        ("tokenizer.ggml.add_bos_token", ("false", GGUFValueType.STRING), "must be a bool, got 'false'"),
        ("tokenizer.ggml.add_bos_token", (0, GGUFValueType.UINT8), "must be a bool, got 0"),
        # a template that is no string made `chat` end in a jinja traceback
        ("tokenizer.chat_template", (7, GGUFValueType.UINT32), "must be a string, got 7"),
        ("tokenizer.ggml.pre", (3, GGUFValueType.UINT32), "must be a string, got 3"),
    ],
)
def test_tokenizer_keys_of_another_type_are_refused_in_one_line(
    model_path, tmp_path, capsys, key, value, message
):
    path = rewrite(model_path, tmp_path / "model.gguf", set_keys={key: value})
    with pytest.raises(ValueError, match=f"^{path}: metadata key {key} {message}$"):
        Tokenizer.from_gguf(path)
    assert main(["chat", str(path), "--max-tokens", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"k3stream chat: error: {path}: metadata key {key} {message}"
    ]


def _merges(model_path) -> list[str]:
    from k3stream.gguf.reader import K3Checkpoint

    return list(K3Checkpoint.open(model_path).metadata("tokenizer.ggml.merges"))


@pytest.fixture(scope="module")
def reordered_path(model_path, tmp_path_factory):
    """The tiny model with its merges reversed: the merge order is not the token order."""
    merges = (_merges(model_path)[::-1], GGUFValueType.ARRAY)
    out = tmp_path_factory.mktemp("merges") / "reordered.gguf"
    return rewrite(model_path, out, set_keys={"tokenizer.ggml.merges": merges})


@pytest.fixture(scope="module")
def reordered_llama(reordered_path):
    import llama_cpp

    llama = llama_cpp.Llama(str(reordered_path), vocab_only=True, verbose=False)
    yield llama
    llama.close()


@requires_llama
def test_merge_order_decides_as_in_llama_cpp(reordered_path, reordered_llama, llama_vocab):
    """The ranks are the merges' order, not the token ids: the reversed merges tokenize other text
    than the tiny model's merges do in llama.cpp, and k3stream tokenizes it the same way."""
    tokenizer = Tokenizer.from_gguf(reordered_path)
    changed = 0
    for text in VARIED:
        for special in (True, False):
            want = _llama_ids(reordered_llama, text, special)
            assert tokenizer.encode(text, allow_special=special, add_bos=False) == want, text
            changed += want != _llama_ids(llama_vocab, text, special)
    assert changed >= len(VARIED) // 2  # the order matters on many of these texts


@requires_llama
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT, special=st.booleans())
def test_random_text_under_reordered_merges_matches_llama_cpp(reordered_path, reordered_llama, text, special):
    tokenizer = Tokenizer.from_gguf(reordered_path)
    assert tokenizer.encode(text, allow_special=special) == _llama_ids(reordered_llama, text, special)


# single words far longer than `bpe.CACHED_WORD_CHARS`, so they take the merge loop uncached
LONG_WORDS = ["the" * 700, "HelloWorld" * 90, "中文文本测试" * 150, "quick" * 600 + "s", "é" * 900]


@requires_llama
def test_long_words_match_llama_cpp_under_either_merge_order(
    model_path, llama_vocab, reordered_path, reordered_llama
):
    from k3stream.gguf.bpe import CACHED_WORD_CHARS

    assert all(len(word) > CACHED_WORD_CHARS for word in LONG_WORDS)
    for path, llama in ((model_path, llama_vocab), (reordered_path, reordered_llama)):
        tokenizer = Tokenizer.from_gguf(path)
        for word in LONG_WORDS:
            want = _llama_ids(llama, word, False)
            assert tokenizer.encode(word, add_bos=False) == want, (path.name, word[:20])
            assert len(want) < len(word.encode())  # the word merged: the loop ran


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("q Ġz", "names 'Ġz', which is no token of the vocabulary"),
        ("q z", "names 'qz', which is no token of the vocabulary"),
        ("qz", "is not two tokens and a space"),
    ],
)
def test_a_merge_naming_no_token_of_the_vocabulary_is_refused_in_one_line(
    model_path, tmp_path, capsys, entry, message
):
    """llama.cpp loads such a file, then turns the words that reach the merge into byte tokens, or drops
    their bytes: the file is broken, so it is refused before any text is tokenized."""
    merges = _merges(model_path)
    merges[3] = entry
    path = rewrite(
        model_path, tmp_path / "bad.gguf", set_keys={"tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY)}
    )
    line = f"{path}: tokenizer.ggml.merges entry 3 {entry!r} {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        Tokenizer.from_gguf(path)
    assert main(["chat", str(path), "--max-tokens", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"k3stream chat: error: {line}"]


@requires_llama
def test_a_vocabulary_without_merges_is_refused_where_llama_cpp_would_split_every_byte(model_path, tmp_path):
    """llama.cpp loads a gpt2 vocabulary without `tokenizer.ggml.merges` and tokenizes each byte alone:
    what the model was never trained on. k3stream refuses the file, naming the key."""
    import llama_cpp

    path = rewrite(model_path, tmp_path / "no-merges.gguf", drop_keys=("tokenizer.ggml.merges",))
    text = "the quick brown fox"
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert _llama_ids(llama, text, False) == list(text.encode())  # a byte's token id is its value here
    llama.close()
    line = f"{path}: metadata tokenizer.ggml.merges is missing; a gpt2 vocabulary of more than its 256 bytes"
    with pytest.raises(ValueError, match=f"^{re.escape(line)} needs its merges$"):
        Tokenizer.from_gguf(path)


@requires_llama
def test_user_defined_tokens_are_parsed_even_where_control_ones_are_not(tiny_model, tmp_path):
    """As llama.cpp: USER_DEFINED text becomes its token with or without special parsing, CONTROL text
    only with it."""
    import llama_cpp

    path, pad = _with_unused_tokens_as(tiny_model(vocab=600), tmp_path, [("<|user|>", 4)])
    tokenizer = Tokenizer.from_gguf(path)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    text = "say <|user|> then <|im_end|> and<|user|><|user|>x"
    for special in (True, False):
        ids = tokenizer.encode(text, allow_special=special, add_bos=False)
        assert ids == _llama_ids(llama, text, special)
        assert ids.count(pad) == 3
        assert (tokenizer.token_id("<|im_end|>") in ids) == special
    llama.close()


@pytest.fixture(scope="module")
def overlapping(tiny_model, tmp_path_factory):
    """A vocabulary whose added tokens overlap (user-defined `abc` and `bcde`, control `<x>` and `x><y`),
    and llama.cpp on it."""
    import llama_cpp

    added = [("abc", 4), ("bcde", 4), ("<x>", 3), ("x><y", 3)]
    path, _ = _with_unused_tokens_as(tiny_model(vocab=600), tmp_path_factory.mktemp("overlapping"), added)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    yield Tokenizer.from_gguf(path), llama
    llama.close()


@requires_llama
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(st.sampled_from([*"abcde<>xy ", "abc", "bcde", "<x>", "x><y"]), max_size=16).map("".join)
)
def test_overlapping_special_tokens_are_cut_as_llama_cpp_cuts_them(overlapping, text):
    """llama.cpp cuts the whole text at each special token in turn, the longest first: in `abcde` the
    token is `bcde`, though `abc` starts first."""
    tokenizer, llama = overlapping
    for special in (True, False):
        assert tokenizer.encode(text, allow_special=special, add_bos=False) == _llama_ids(
            llama, text, special
        )


@requires_llama
def test_a_decode_that_skips_special_tokens_writes_user_defined_ones_as_llama_cpp(tiny_model, tmp_path):
    """llama.cpp's detokenizer without special tokens drops CONTROL and UNKNOWN tokens but writes a
    USER_DEFINED one's text (a word the vocabulary added); k3stream dropped it too."""
    import llama_cpp

    path, user = _with_unused_tokens_as(tiny_model(vocab=600), tmp_path, [("<|user|>", 4), ("<unk>", 2)])
    unknown = user + 1
    tokenizer = Tokenizer.from_gguf(path)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ids = [*tokenizer.encode("hi"), user, unknown, tokenizer.token_id("<|im_end|>"), unknown + 1, user]
    for special in (True, False):
        assert tokenizer.decode_bytes(ids, skip_special=not special) == _llama_detokenize(llama, ids, special)
    assert tokenizer.decode(ids, skip_special=True) == "hi<|user|><|user|>"
    llama.close()


LLAMA_VOCAB_LOAD = "import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)"


@requires_llama
@pytest.mark.parametrize(
    ("copied", "kind"),
    [("Ġthe", 4), ("<|im_end|>", 3), ("Ġthe", 5)],
    ids=["user-defined copy of a normal token", "control copy of a control token", "unused copy"],
)
def test_a_vocabulary_with_two_ids_of_one_text_is_refused_in_one_line(
    tiny_model, tmp_path, capsys, copied, kind
):
    """An added token whose text the vocabulary already holds: llama.cpp aborts on the file (it maps each
    text to one id), and k3stream refuses it naming both entries (it took one of the ids in silence),
    `pack` too, before it writes anything."""
    import subprocess
    import sys

    from k3stream.gguf.reader import K3Checkpoint

    source = tiny_model(vocab=600)
    checkpoint = K3Checkpoint.open(source)
    tokens = list(checkpoint.metadata("tokenizer.ggml.tokens"))
    types = [int(t) for t in checkpoint.metadata("tokenizer.ggml.token_type")]
    pad = types.index(5)
    tokens[pad], types[pad] = copied, kind
    arrays = {
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY),
    }
    path = rewrite(source, tmp_path / "twice.gguf", set_keys=arrays)
    llama = subprocess.run([sys.executable, "-c", LLAMA_VOCAB_LOAD, str(path)], capture_output=True)
    assert llama.returncode != 0
    line = (
        f"{path}: tokenizer.ggml.tokens entries {tokens.index(copied)} and {pad} are the same text {copied!r}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        Tokenizer.from_gguf(path)
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"k3stream generate: error: {line}"]
    assert main(["pack", str(path), "--no-progress"]) == 1  # no pack of a file no command can run
    assert capsys.readouterr().err.strip().splitlines() == [f"k3stream pack: error: {line}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


LLAMA_END_IDS = """
import json, sys, llama_cpp
model = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(model.model)
print(json.dumps([i for i in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]))
"""
# chat formats' end marks, and texts that end nothing, as added tokens of a Kimi vocabulary
ADDED_ENDS = ["<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "<｜end▁of▁sentence｜>", "<|fim_pad|>"]
ADDED_OTHERS = ["<|im_start|>", "<|end_of_msg|>"]


@requires_llama
@pytest.mark.parametrize("eos", ["[EOS]", "<|im_end|>"])
def test_generation_ends_at_the_tokens_llama_cpp_ends_at(tiny_model, tmp_path, eos):
    """A file whose eos is Kimi's `[EOS]` (as its tokenizer_config names it): llama.cpp still ends at
    `<|im_end|>` and `[EOT]` and the other formats' end marks; so does k3stream (it ran on past them, an
    answer followed by invented turns), and `--ignore-eos` bans every one of them."""
    import json
    import subprocess
    import sys

    from k3stream.commands.flags import with_ends
    from k3stream.engine.generate import FINISH_STOP, Sequence
    from k3stream.engine.sampling import SamplingParams
    from k3stream.gguf.reader import K3Checkpoint

    source = tiny_model(vocab=600)
    checkpoint = K3Checkpoint.open(source)
    tokens = list(checkpoint.metadata("tokenizer.ggml.tokens"))
    types = [int(t) for t in checkpoint.metadata("tokenizer.ggml.token_type")]
    first_pad = types.index(5)
    for index, text in enumerate(ADDED_ENDS + ADDED_OTHERS, start=first_pad):
        tokens[index], types[index] = text, 3
    keys = {
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY),
        "tokenizer.ggml.eos_token_id": (tokens.index(eos), GGUFValueType.UINT32),
    }
    path = rewrite(source, tmp_path / "ends.gguf", set_keys=keys)
    llama = subprocess.run([sys.executable, "-c", LLAMA_END_IDS, str(path)], capture_output=True, text=True)
    expected = json.loads(llama.stdout.strip().splitlines()[-1])
    tokenizer = Tokenizer.from_gguf(path)
    assert sorted(tokenizer.end_ids) == expected
    assert {tokens[i] for i in expected} >= {"[EOS]", "<|im_end|>", "[EOT]", *ADDED_ENDS}
    for token in expected:
        sequence = Sequence(tokenizer, [1], SamplingParams(max_tokens=8))
        sequence.accept(token)
        assert sequence.finish_reason == FINISH_STOP, tokens[token]
    banned = with_ends(SamplingParams(ignore_eos=True), tokenizer, ()).logit_bias
    assert sorted(token for token, _bias in banned) == expected


@requires_llama
def test_end_marks_are_control_tokens_whatever_type_the_file_gives_them(model_path, tmp_path):
    """A file without tokenizer.ggml.token_type (every token NORMAL): llama.cpp still takes the end marks
    it knows by their text (`<|im_end|>`, `[EOS]`, `[EOT]`, Kimi's `[PAD]`) as control tokens, so a
    prompt's `<|im_end|>` is one token there; k3stream cut it into bytes."""
    import llama_cpp

    path = rewrite(model_path, tmp_path / "untyped.gguf", drop_keys=("tokenizer.ggml.token_type",))
    tokenizer = Tokenizer.from_gguf(path)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    text = "a<|im_end|> b [EOS]x[EOT]<|im_user|>[PAD] [BOS]"
    for special in (True, False):
        assert tokenizer.encode(text, allow_special=special, add_bos=False) == _llama_ids(
            llama, text, special
        )
    assert tokenizer.encode("<|im_end|>", allow_special=True, add_bos=False) == [
        tokenizer.token_id("<|im_end|>")
    ]
    llama.close()


def test_generate_builds_a_files_tokenizer_once(model_path, tmp_path, caplog, capsys):
    """The prompt's ids are made before the load, and the load asks for the tokenizer again: one build,
    so a file's warning (here an out-of-range BOS id) is said once."""
    bad_bos = rewrite(
        model_path,
        tmp_path / "bad-bos.gguf",
        set_keys={"tokenizer.ggml.bos_token_id": (99999, GGUFValueType.UINT32)},
    )
    with caplog.at_level("WARNING"):
        assert main(["generate", str(bad_bos), "--prompt", "hi", "-n", "2", "--no-stream-experts"]) == 0
    assert caplog.text.count("tokenizer.ggml.bos_token_id is 99999") == 1


def _with_unused_tokens_as(source, tmp_path, replacements: list[tuple[str, int]]):
    """A copy of `source` whose first UNUSED padding tokens become `replacements` (text, GGML token
    type) in turn; returns it and the first replaced id."""
    from k3stream.gguf.reader import K3Checkpoint

    checkpoint = K3Checkpoint.open(source)
    tokens = list(checkpoint.metadata("tokenizer.ggml.tokens"))
    types = [int(t) for t in checkpoint.metadata("tokenizer.ggml.token_type")]
    first = types.index(5)
    for offset, (text, kind) in enumerate(replacements):
        tokens[first + offset], types[first + offset] = text, kind
    arrays = {
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY),
    }
    return rewrite(source, tmp_path / "user-defined.gguf", set_keys=arrays), first
