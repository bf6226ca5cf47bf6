"""A byte-level BPE vocabulary learned with `tokenizers`, stored as the tiny models' (and Kimi's) is.

`tokenizers` learns merges over words cut by the `kimi-k2` pre-tokenizer regex; the merge results in
learned order become tokens 256.. after the 256 bytes (rank = id, as Kimi's tiktoken vocabulary), then
the special tokens (`gguf.vocab.vocab_from_learned`). The GGUF's merge list is derived from the ranks,
so llama.cpp and `engine.tokenizer.Tokenizer` tokenize alike.
"""

from __future__ import annotations

import json

from k3stream.engine.tokenizer import KIMI_K2_PATTERN, Tokenizer, VocabFields, token_text_to_bytes
from k3stream.gguf.vocab import SPECIAL_TOKENS, Vocab, vocab_from_learned


def learn_vocab(texts: list[str], size: int) -> Vocab:
    """A vocabulary of at most `size` tokens (bytes, merges, specials) learned from `texts`."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    merges = size - 256 - len(SPECIAL_TOKENS)
    if merges < 1:
        raise ValueError(f"--vocab-size {size}: no room for merges after 256 bytes and the special tokens")
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_K2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(texts, trainer)
    merged = json.loads(bpe.to_str())["model"]["merges"]
    learned = [token_text_to_bytes(left + right, "bpe merges") for left, right in merged]
    return vocab_from_learned(list(dict.fromkeys(learned)))


def vocab_tokenizer(vocab: Vocab) -> Tokenizer:
    """The runtime tokenizer of `vocab`, as `Tokenizer.from_gguf` builds it from the written file."""
    fields = VocabFields(
        tokens=list(vocab.tokens),
        token_types=list(vocab.token_types),
        model="gpt2",
        pre="kimi-k2",
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        source="trained vocabulary",
        merges=list(vocab.merges),
    )
    return Tokenizer(fields)
