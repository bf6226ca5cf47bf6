"""Kimi tokenizer rebuilt from GGUF metadata, tokenizing as llama.cpp does.

Kimi ships a tiktoken vocabulary; its GGUF keeps it as a `gpt2` vocabulary: tokens written in GPT-2's
byte-to-unicode alphabet, a token type per id (the special tokens CONTROL) and `tokenizer.ggml.merges`,
which the converter derives from the tiktoken ranks (a token's last pair, in token order). As llama.cpp,
we cut text at special tokens, then into the pieces llama.cpp's `kimi-k2` pre-tokenizer cuts, and
merge each piece's bytes by the merge list (`gguf.bpe.MergeBPE`): a file whose merges are in another
order than its tokens tokenizes as llama.cpp tokenizes it. A `gpt2` vocabulary without merges is
refused (llama.cpp 0.3.36 loads one and tokenizes every byte alone), and so is a merge naming a text
that is no token.
"""

from __future__ import annotations

import codecs
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import regex

from k3stream.engine.end_tokens import FIM_KINDS, end_of_generation_ids, found_by_text
from k3stream.gguf.bpe import MergeBPE, byte_to_unicode

log = logging.getLogger(__name__)

# Pre-tokenizer of tokenization_kimi.py (tiktoken's `pat_str`, for `Tokenizer.encoding`): Han runs, words
# (Han excluded) with English contractions, digits in groups of up to three, punctuation runs, newlines,
# other whitespace.
KIMI_K2_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# The Han of llama.cpp's `unicode_cpt_is_han`: the CJK ideograph blocks (not the Han script's other
# characters, such as 々 〇 and the radicals, which tokenization_kimi.py's \p{Han} holds)
LLAMA_HAN = (
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"
)
# The letters and numbers of Unicode 16.0 and 17.0, which llama.cpp's character tables (Unicode 15.1)
# leave unassigned: no letter nor number there (the `regex` module knows them as such)
UNICODE_16_LETTERS_AND_NUMBERS = (
    "\u088f\u0c5c\u0cdc\u1c89-\u1c8a\ua7cb-\ua7cf\ua7d2\ua7d4\ua7da-\ua7dc\ua7f1"
    "\U000105c0-\U000105f3\U00010940-\U00010959\U00010d40-\U00010d65\U00010d6f-\U00010d85"
    "\U00010ec2-\U00010ec7\U00011380-\U00011389\U0001138b\U0001138e\U00011390-\U000113b5"
    "\U000113b7\U000113d1\U000113d3\U000116d0-\U000116e3\U00011bc0-\U00011be0"
    "\U00011bf0-\U00011bf9\U00011db0-\U00011ddb\U00011de0-\U00011de9\U00013460-\U000143fa"
    "\U00016100-\U0001611d\U00016130-\U00016139\U00016d40-\U00016d6c\U00016d70-\U00016d79"
    "\U00016ea0-\U00016eb8\U00016ebb-\U00016ed3\U00016ff2-\U00016ff6\U000187f8-\U000187ff"
    "\U00018cff\U00018d09-\U00018d1e\U00018d80-\U00018df2\U0001ccf0-\U0001ccf9"
    "\U0001e5d0-\U0001e5ed\U0001e5f0-\U0001e5fa\U0001e6c0-\U0001e6de\U0001e6e0-\U0001e6e2"
    "\U0001e6e4-\U0001e6e5\U0001e6e7-\U0001e6ed\U0001e6f0-\U0001e6f4\U0001e6fe-\U0001e6ff"
    "\U0002b73a-\U0002b73f\U0002cea2-\U0002cead\U000323b0-\U00033479"
)
# llama.cpp's letters, numbers and both (V1 set syntax: `--` is set difference)
_LETTER = f"[\\p{{L}}--[{LLAMA_HAN}{UNICODE_16_LETTERS_AND_NUMBERS}]]"  # Han ideographs aside
_NUMBER = f"[\\p{{N}}--[{UNICODE_16_LETTERS_AND_NUMBERS}]]"
_LETTER_OR_NUMBER = f"[\\p{{L}}\\p{{N}}--[{UNICODE_16_LETTERS_AND_NUMBERS}]]"
# The pieces llama.cpp's `kimi-k2` pre-tokenizer cuts (`unicode_regex_split_custom_kimi_k2`), which is
# KIMI_K2_PATTERN as llama.cpp writes it out: a word is any run of letters (upper and lower case alike,
# `HelloWorld` one piece), and a combining mark is no letter (`e` + U+0301 two pieces), as in llama.cpp.
LLAMA_KIMI_K2_PATTERN = "|".join(
    [
        f"[{LLAMA_HAN}]+",
        f"[^\\r\\n{_LETTER_OR_NUMBER}]?{_LETTER}+(?:'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL]))?",
        f"{_NUMBER}{{1,3}}",
        f" ?[^\\s{_LETTER_OR_NUMBER}]+[\\r\\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
_PRETOKENIZER = regex.compile(LLAMA_KIMI_K2_PATTERN, flags=regex.V1)

TOOL_USE_TEMPLATE_KEY = "tokenizer.chat_template.tool_use"  # the named template `tool_use`

# gguf.TokenType values
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the alphabet GGUF BPE tokens are written in)."""
    return {char: byte for byte, char in byte_to_unicode().items()}


def token_text_to_bytes(text: str, source: str = "tokenizer") -> bytes:
    """Bytes of a token written in GPT-2's byte-to-unicode alphabet."""
    table = _unicode_to_byte()
    try:
        return bytes(table[ch] for ch in text)
    except KeyError as exc:
        raise ValueError(
            f"{source}: token {text!r} has a character outside the byte alphabet: {exc}"
        ) from None


@dataclass(frozen=True)
class VocabFields:
    """The tokenizer part of GGUF metadata."""

    tokens: list[str]
    token_types: list[int]
    model: str
    pre: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None
    source: str = "tokenizer"
    chat_template_tool_use: str | None = None  # tokenizer.chat_template.tool_use: for requests with tools
    merges: list[str] | None = None  # tokenizer.ggml.merges (None: the file has none)
    # tokenizer.ggml.<name>_token_id of the ids that end a generation besides eos (end_tokens.py)
    end_keys: dict[str, int | None] = field(default_factory=dict)


def _token_id(metadata: Callable[[str, Any], Any], key: str, vocab: int, source: str) -> int | None:
    """The token id at `key` (None when absent). A value that is not an integer is refused naming the
    key; an integer outside the vocabulary is dropped with a warning naming it, as llama.cpp does ("bad
    special token"), so a file llama.cpp runs runs here."""
    value = metadata(key, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} is {value!r}, not a token id")
    if not 0 <= value < vocab:
        log.warning(
            "%s: %s is %d, not a token id of the %d-token vocabulary: ignored", source, key, value, vocab
        )
        return None
    return value


def _typed(metadata: Callable[[str, Any], Any], key: str, kind: type, source: str) -> Any:
    """The value at `key` (None when absent); a value of another GGUF type is refused naming the key,
    as llama.cpp refuses it ("wrong type"): a string "false" must not read as a true flag."""
    value = metadata(key, None)
    if value is not None and not isinstance(value, kind):
        what = {str: "string", bool: "bool"}.get(kind, kind.__name__)
        raise ValueError(f"{source}: metadata key {key} must be a {what}, got {value!r}")
    return value


def _read_fields(metadata: Callable[[str, Any], Any], source: str) -> VocabFields:
    tokens = metadata("tokenizer.ggml.tokens", None)
    if not tokens:
        raise ValueError(f"{source}: metadata tokenizer.ggml.tokens is missing")
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"{source}: metadata key tokenizer.ggml.tokens must be an array of strings")
    types = metadata("tokenizer.ggml.token_type", None)
    if types is not None and (
        not isinstance(types, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in types)
    ):
        raise ValueError(f"{source}: metadata key tokenizer.ggml.token_type must be an array of integers")
    token_types = list(types) if types is not None else [TOKEN_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    merges = metadata("tokenizer.ggml.merges", None)
    if merges is not None and (
        not isinstance(merges, list) or not all(isinstance(merge, str) for merge in merges)
    ):
        raise ValueError(f"{source}: metadata key tokenizer.ggml.merges must be an array of strings")
    bos, eos = (
        _token_id(metadata, f"tokenizer.ggml.{name}_token_id", len(tokens), source) for name in ("bos", "eos")
    )
    end_keys = {
        name: _token_id(metadata, f"tokenizer.ggml.{name}_token_id", len(tokens), source)
        for name in ("eot", "eom", *FIM_KINDS)
    }
    return VocabFields(
        tokens=[str(t) for t in tokens],
        token_types=token_types,
        model=_typed(metadata, "tokenizer.ggml.model", str, source) or "",
        pre=_typed(metadata, "tokenizer.ggml.pre", str, source) or "",
        bos_id=bos,
        eos_id=eos,
        add_bos=bool(_typed(metadata, "tokenizer.ggml.add_bos_token", bool, source)),
        chat_template=_typed(metadata, "tokenizer.chat_template", str, source),
        chat_template_tool_use=_typed(metadata, TOOL_USE_TEMPLATE_KEY, str, source),
        source=source,
        merges=merges,
        end_keys=end_keys,
    )


def _text_ids(fields: VocabFields) -> dict[str, int]:
    """Each token text's id. A vocabulary where two ids share one text, whatever their types, is refused:
    llama.cpp maps each text to one id and aborts on such a file; which id the text means would be a
    guess."""
    id_of: dict[str, int] = {}
    for token_id, text in enumerate(fields.tokens):
        earlier = id_of.setdefault(text, token_id)
        if earlier != token_id:
            raise ValueError(
                f"{fields.source}: tokenizer.ggml.tokens entries {earlier} and {token_id} are the same "
                f"text {text!r}"
            )
    return id_of


def _longest_first(specials: Iterable[str]) -> tuple[str, ...]:
    """The special tokens' texts in the order llama.cpp cuts text at them: the longest first (those of
    one length in vocabulary order; llama.cpp leaves their order open)."""
    return tuple(sorted((text for text in specials if text), key=len, reverse=True))


class Tokenizer:
    """Encode/decode with a Kimi vocabulary; ids are the GGUF token ids."""

    def __init__(self, fields: VocabFields):
        if fields.model != "gpt2":
            raise ValueError(f"{fields.source}: tokenizer.ggml.model is {fields.model!r}, expected 'gpt2'")
        if fields.pre != "kimi-k2":
            raise ValueError(f"{fields.source}: tokenizer.ggml.pre is {fields.pre!r}, expected 'kimi-k2'")
        self.source = fields.source
        self.bos_id, self.eos_id, self.add_bos = fields.bos_id, fields.eos_id, fields.add_bos
        self.chat_template, self.chat_template_tool_use = fields.chat_template, fields.chat_template_tool_use
        self.vocab_size = len(fields.tokens)
        # the ids that end a generation, as llama.cpp takes them: eos and the end-of-turn marks
        id_of = _text_ids(fields)
        self.end_ids = end_of_generation_ids(id_of, {**fields.end_keys, "eos": fields.eos_id})
        self._ranks, special, user_defined = self._split_vocab(fields, id_of)
        if fields.merges is None and len(self._ranks) > 256:
            raise ValueError(
                f"{fields.source}: metadata tokenizer.ggml.merges is missing; a gpt2 vocabulary of more "
                "than its 256 bytes needs its merges"
            )
        self._bpe = MergeBPE(fields.merges or [], id_of, fields.source)
        self.special_tokens: dict[str, int] = special
        self._special_cuts = {
            allow_special: _longest_first(special if allow_special else user_defined)
            for allow_special in (True, False)
        }
        self._pieces = [b""] * self.vocab_size
        for piece, token_id in self._ranks.items():
            self._pieces[token_id] = piece
        self._special_pieces = {token_id: text.encode() for text, token_id in special.items()}
        # the tokens a decode that skips special ones still writes, as llama.cpp writes user-defined ones
        self._user_defined_ids = frozenset(special[text] for text in user_defined)

    @cached_property
    def encoding(self) -> Any:
        """A tiktoken Encoding of the vocabulary (ranks = token ids, special tokens): the vocabulary as
        byte strings, for grammar libraries (`encode` tokenizes by the merges, not through it)."""
        import tiktoken

        return tiktoken.Encoding(
            name=f"kimi-k2:{self.source}",
            pat_str=KIMI_K2_PATTERN,
            mergeable_ranks=self._ranks,
            special_tokens=self.special_tokens,
        )

    @staticmethod
    def _split_vocab(
        fields: VocabFields, id_of: dict[str, int]
    ) -> tuple[dict[bytes, int], dict[str, int], list[str]]:
        """The byte pieces' ranks, the special tokens and the user-defined ones; `id_of`: each text's id."""
        ranks: dict[bytes, int] = {}
        special: dict[str, int] = {}
        user_defined: list[str] = []
        marks = found_by_text(id_of, fields.end_keys)  # control tokens whatever their type, as in llama.cpp
        for token_id, (text, kind) in enumerate(zip(fields.tokens, fields.token_types, strict=True)):
            if kind == TOKEN_NORMAL:
                ranks[token_text_to_bytes(text, fields.source)] = token_id
            if kind in _SPECIAL_TYPES or token_id in marks:
                special[text] = token_id
                if kind == TOKEN_USER_DEFINED:
                    user_defined.append(text)
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(
                f"{fields.source}: vocabulary lacks {len(missing)} single-byte tokens (first {missing[0]})"
            )
        return ranks, special, user_defined

    @classmethod
    def from_gguf(cls, path_or_checkpoint: Any) -> Tokenizer:
        """From a GGUF path (any shard) or an opened `K3Checkpoint`."""
        from k3stream.gguf.reader import K3Checkpoint

        if not isinstance(path_or_checkpoint, K3Checkpoint):
            return cls._build(K3Checkpoint.open(Path(path_or_checkpoint)))
        # commands ask before the load (the prompt's ids) and the load asks again: one build, one warning
        built = _BY_CHECKPOINT.get(path_or_checkpoint)
        if built is None:
            built = _BY_CHECKPOINT[path_or_checkpoint] = cls._build(path_or_checkpoint)
        return built

    @classmethod
    def _build(cls, checkpoint: Any) -> Tokenizer:
        return cls(_read_fields(checkpoint.metadata, str(checkpoint.shards[0])))

    def encode(self, text: str, *, allow_special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text becomes those tokens only when `allow_special` (the
        USER_DEFINED ones always, as llama.cpp parses them).

        `add_bos=None` follows the file's tokenizer.ggml.add_bos_token.
        """
        adds_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if adds_bos and self.bos_id is not None else []
        for fragment in self.special_split(text, allow_special=allow_special):
            ids += [fragment] if isinstance(fragment, int) else self.encode_plain(fragment)
        return ids

    def special_split(self, text: str, *, allow_special: bool = True) -> list[str | int]:
        """`text` cut where llama.cpp cuts it before its pre-tokenizer: the ids of the special tokens it
        holds (as `encode` parses them) and the texts between them (empty ones left out). As llama.cpp,
        the whole text is cut at each special token in turn, the longest first, so where two overlap
        (`abc` and `bcde` in `abcde`) the longer is the token, wherever it starts."""
        fragments: list[str | int] = [text]
        for special in self._special_cuts[allow_special]:
            if special in text:
                fragments = [piece for fragment in fragments for piece in self._cut_at(fragment, special)]
        return [fragment for fragment in fragments if fragment != ""]

    def _cut_at(self, fragment: str | int, special: str) -> list[str | int]:
        """A text fragment cut at each place that spells `special` (from the left, as llama.cpp finds
        them), that token's id between the parts; a token already cut out stays as it is."""
        if isinstance(fragment, int) or special not in fragment:
            return [fragment]
        token = self.special_tokens[special]
        parts: list[str | int] = []
        for index, part in enumerate(fragment.split(special)):
            parts += [token, part] if index else [part]
        return parts

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: no special token is ever produced (not even the
        user-defined ones `encode` always parses), no BOS. For untrusted text such as chat content."""
        word_ids = self._bpe.word_ids
        return [token for word in _PRETOKENIZER.findall(text) for token in word_ids(word)]

    def piece(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """Bytes of one token (special tokens as their text unless skipped, user-defined ones always, as
        llama.cpp writes them; unused ids are empty)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"{self.source}: token id {token_id} is outside the vocabulary of {self.vocab_size}"
            )
        special = self._special_pieces.get(token_id)
        if special is not None:
            return b"" if skip_special and token_id not in self._user_defined_ids else special
        return self._pieces[token_id]

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        return b"".join(self.piece(int(i), skip_special=skip_special) for i in ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int:
        """Id of a special token such as `<|end_of_msg|>`."""
        try:
            return self.special_tokens[text]
        except KeyError:
            raise ValueError(f"{self.source}: no special token {text!r}") from None

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns tokens into text one at a time, holding back UTF-8 sequences split across tokens."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: int | Sequence[int]) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, skip_special=self._skip_special))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# the tokenizer built for each open checkpoint, while it is open
_BY_CHECKPOINT: weakref.WeakKeyDictionary[Any, Tokenizer] = weakref.WeakKeyDictionary()
