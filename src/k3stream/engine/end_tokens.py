"""The tokens that end a generation, chosen as llama.cpp's vocabulary loader chooses them (llama-vocab.cpp,
llama-cpp-python 0.3.36): the file's eos, eot and eom ids, and every token whose text is an end-of-turn or
end-of-text mark of a known chat format, whatever the file's eos names. A Kimi file whose eos is `[EOS]`
still ends at `<|im_end|>` and `[EOT]`, as llama.cpp ends it. The marks found by their text are control
tokens whatever type the file gives them, as llama.cpp takes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# the keys whose token ends a generation (llama.cpp: special_eos_id, special_eot_id, special_eom_id)
END_KEYS = ("eos", "eot", "eom")
# fill-in-the-middle tokens llama.cpp also ends at: each kind's key, else the first text of the kind the
# vocabulary holds (Kimi's `[PAD]` is its fim pad)
FIM_KINDS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
END_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
    }
)


def end_of_generation_ids(id_of: Mapping[str, int], keyed: Mapping[str, int | None]) -> frozenset[int]:
    """The ids that end a generation in a vocabulary whose token texts have the ids `id_of`; `keyed` maps
    `eos`, `eot`, `eom`, `fim_pad`, `fim_rep`, `fim_sep` to the file's `tokenizer.ggml.<name>_token_id`
    (None: absent)."""
    ends = {keyed.get(name) for name in (*END_KEYS, *FIM_KINDS)} | found_by_text(id_of, keyed)
    ends.discard(None)
    return frozenset(ends - _format_exceptions(id_of))


def found_by_text(id_of: Mapping[str, int], keyed: Mapping[str, int | None]) -> set[int]:
    """The end ids llama.cpp finds by their text (`id_of`: each token text's id): every known end mark,
    and the first text of each fill-in-the-middle kind the file names no id for. llama.cpp takes each as
    a control token whatever type the file gives it."""
    found = {id_of[text] for text in END_TEXTS if text in id_of}
    for kind, texts in FIM_KINDS.items():
        if keyed.get(kind) is None:
            found.update(list(_present(texts, id_of))[:1])
    return found


def _present(texts: Sequence[str], id_of: Mapping[str, int]):
    return (id_of[text] for text in texts if text in id_of)


def _format_exceptions(id_of: Mapping[str, int]) -> set[int]:
    """llama.cpp's two exceptions: the harmony and solar formats' `<|end|>` ends a message, not the
    answer; gemma's and paddleocr's `</s>` is no end where `<|tool_response>` is."""
    dropped = set()
    has = id_of.__contains__
    if "<|end|>" in id_of and (
        (has("<|return|>") and has("<|call|>")) or (has("<|calls|>") and has("<|flush|>"))
    ):
        dropped.add(id_of["<|end|>"])
    if "</s>" in id_of and has("<|tool_response>"):
        dropped.add(id_of["</s>"])
    return dropped
