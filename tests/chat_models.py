"""Tiny Kimi GGUFs with another chat template or extra special tokens, for the tool-call and reasoning
tests: a copy of a generated tiny model with its tokenizer metadata changed and every tensor copied
byte for byte (same weights, same vocabulary size).
"""

from __future__ import annotations

from pathlib import Path

from k3stream.gguf.vocab import CHAT_TEMPLATE

# The tiny models' Kimi-K2 chat template (tools, tool calls and tool results, `gguf.vocab.CHAT_TEMPLATE`)
# plus `thinking` to open a think block as Kimi-K2-Thinking's generation prompt does, and an assistant
# turn's `reasoning_content` in its think block, as Kimi-K2-Thinking's template writes it back.
_ASSISTANT_OPENED = "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
KIMI_TOOL_TEMPLATE = CHAT_TEMPLATE.replace(
    _GENERATION_PROMPT,
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- endif -%}{%- endif -%}",
).replace(
    _ASSISTANT_OPENED,
    _ASSISTANT_OPENED
    + "{%- if message['reasoning_content'] -%}<think>{{ message['reasoning_content'] }}</think>{%- endif -%}",
)


def retokenized(
    source: Path,
    out: Path,
    *,
    chat_template: str | None,
    special_tokens: tuple[str, ...] = (),
    tool_use_template: str | None = None,
) -> Path:
    """`out`: `source` (a one-file tiny GGUF made with a padded `vocab`) with `tokenizer.chat_template`
    replaced (None: removed), `tokenizer.chat_template.tool_use` written when given, and its first
    padding tokens renamed to `special_tokens` (CONTROL)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from k3stream.gguf.config import ARCH
    from k3stream.gguf.layout import FLOAT_TYPE_IDS
    from k3stream.gguf.reader import K3Checkpoint

    checkpoint = K3Checkpoint.open(source)
    tokens = list(checkpoint.metadata("tokenizer.ggml.tokens"))
    types = [int(t) for t in checkpoint.metadata("tokenizer.ggml.token_type")]
    pads = [i for i, text in enumerate(tokens) if text.startswith("[PAD") and types[i] == 5]
    if len(pads) < len(special_tokens):
        raise ValueError(f"{source}: {len(pads)} padding tokens, {len(special_tokens)} special tokens asked")
    for index, text in zip(pads, special_tokens, strict=False):
        tokens[index], types[index] = text, 3
    replaced = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    writer = GGUFWriter(out, ARCH)
    for key, field in checkpoint.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "tokenizer.chat_template")):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, replaced.get(key, field.contents()), field.types[0], sub_type=sub_type)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    if tool_use_template is not None:
        writer.add_string("tokenizer.chat_template.tool_use", tool_use_template)
    for name, info in checkpoint.tensors.items():
        if info.ggml_type not in FLOAT_TYPE_IDS:
            raise ValueError(f"{source}: {name} is quantized; make the source with the f32 or f16 recipe")
        writer.add_tensor(name, checkpoint.array(name), raw_dtype=GGMLQuantizationType(info.ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
