"""A byte-level BPE vocabulary stored the way Kimi GGUFs store theirs.

Tokens 0..255 are the single bytes (GPT-2 byte-to-unicode spelling), then learned merges (token 256+i
is merge i), then Kimi's special tokens. Ranks equal token ids, so a tiktoken-style encoder built from
the token list and llama.cpp's merge-rank BPE agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from k3stream.gguf.bpe import byte_to_unicode

# Kimi's special tokens, in the order of their ids in the real vocabulary (163584...).
SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "[UNK]",
    "[PAD]",
)
BOS, EOS, PAD = "[BOS]", "<|im_end|>", "[PAD]"

# Kimi-K2's chat template: tools declared in a `tool_declare` system message, an assistant's `tool_calls`
# as its tool-call section, a `tool` message as a `tool` system turn `## Return of ID` then its content.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}"
    "<|im_end|>{%- endif -%}"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}\n{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}"
    "<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- else -%}{{ message['content'] }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int


def spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def rank_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop over `token`, using only ranks below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        candidates = [
            (ranks[left + right], i)
            for i, (left, right) in enumerate(pairwise(parts))
            if ranks.get(left + right, max_rank) < max_rank
        ]
        if not candidates:
            return parts
        _, i = min(candidates)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def _merges(ranks: dict[bytes, int]) -> list[str]:
    """The merge list Kimi's converter derives from tiktoken ranks (a token's last pair)."""
    merges = []
    for token, rank in ranks.items():
        parts = rank_bpe(ranks, token, rank) if len(token) > 1 else []
        if len(parts) == 2:
            merges.append(f"{spell(parts[0])} {spell(parts[1])}")
    return merges


def vocab_from_learned(learned: list[bytes]) -> Vocab:
    """Bytes, then `learned` (merge results in the order they were learned), then the special tokens."""
    ordinary = [bytes([b]) for b in range(256)] + learned
    ranks = {token: rank for rank, token in enumerate(ordinary)}
    tokens = [spell(token) for token in ordinary] + list(SPECIAL_TOKENS)
    types = [1] * len(ordinary) + [3] * len(SPECIAL_TOKENS)  # gguf TokenType NORMAL, CONTROL
    return Vocab(
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=tuple(_merges(ranks)),
        bos_id=tokens.index(BOS),
        eos_id=tokens.index(EOS),
        pad_id=tokens.index(PAD),
    )


def padded(vocab: Vocab, size: int) -> Vocab:
    """The vocabulary grown to `size` rows with UNUSED `[PADi]` tokens, as Kimi's converter pads."""
    if size < len(vocab.tokens):
        raise ValueError(f"vocab {size} is smaller than the built-in tokenizer's {len(vocab.tokens)} tokens")
    extra = range(len(vocab.tokens), size)
    return Vocab(
        tokens=vocab.tokens + tuple(f"[PAD{i}]" for i in extra),
        token_types=vocab.token_types + (5,) * len(extra),  # gguf TokenType.UNUSED
        merges=vocab.merges,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
    )
