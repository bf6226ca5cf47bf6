"""Chat templates: the GGUF's own (checked against llama.cpp's renderer) and the built-in Kimi-K3 one."""

from __future__ import annotations

import copy
import ctypes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import requires_llama
from k3stream.engine.chat import MAX_LOOP_STEPS, ChatTemplate
from k3stream.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_model())


@pytest.fixture(scope="module")
def no_template_tokenizer(tokenizer) -> Tokenizer:
    bare = copy.copy(tokenizer)
    bare.chat_template = None
    return bare


def _llama_render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """llama.cpp's built-in C++ renderer, which recognises the Kimi-K2 format from the template text."""
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[
            llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
            for m in messages
        ]
    )
    size = 64 + 4 * sum(len(m["content"].encode()) + 64 for m in messages)
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(
        template.encode(), chat, len(messages), add_generation_prompt, buffer, size
    )
    assert 0 < n <= size
    return buffer.raw[:n].decode()


_CONTENT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=30)
_CONVERSATION = st.lists(st.tuples(st.sampled_from(["user", "assistant"]), _CONTENT), min_size=1, max_size=5)


@requires_llama
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=_CONTENT, turns=_CONVERSATION, add_generation_prompt=st.booleans())
def test_file_template_matches_llama_cpp(tokenizer, system, turns, add_generation_prompt):
    messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
    template = ChatTemplate.for_tokenizer(tokenizer)
    assert not template.is_builtin
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _llama_render(tokenizer.chat_template, messages, add_generation_prompt)


def test_file_template_adds_its_default_system_message(tokenizer):
    text = ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_rendered_prompt_tokenizes_to_special_tokens(tokenizer):
    text = ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(text, allow_special=True)
    for name in ("<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"):
        assert tokenizer.token_id(name) in ids
    assert tokenizer.decode(ids) == text


# The Kimi-K3 message format, as llama.cpp's kimi-k3 chat parser spells it (common/parsers/kimi-k3.cpp).
K3_USER = '<|open|>message role="user"<|sep|>{}<|close|>message<|sep|><|end_of_msg|>'
K3_SYSTEM = '<|open|>message role="system"<|sep|>{}<|close|>message<|sep|><|end_of_msg|>'
K3_ASSISTANT = (
    '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>{}<|close|>response<|sep|>'
    "<|close|>message<|sep|><|end_of_msg|>"
)
K3_GENERATION_PROMPT = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
K3_THINKING_PROMPT = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def test_builtin_kimi_k3_template_when_the_file_has_none(no_template_tokenizer):
    template = ChatTemplate.for_tokenizer(no_template_tokenizer)
    assert template.is_builtin
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Bye"},
    ]
    expected = K3_SYSTEM.format("Be brief.") + K3_USER.format("Hi") + K3_ASSISTANT.format("Hello")
    expected += K3_USER.format("Bye")
    assert template.render(messages, add_generation_prompt=False) == expected
    assert template.render(messages) == expected + K3_GENERATION_PROMPT
    assert template.render(messages, thinking=True) == expected + K3_THINKING_PROMPT


def test_templates_run_sandboxed():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", source="evil.gguf")
    with pytest.raises(ValueError, match="^evil.gguf: cannot render"):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "text",
    [
        "{{ 1 / 0 }}",
        "{{ 1 + 'a' }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% for i in range(10**9) %}{% endfor %}",
        "{{ 'x' * 10**12 }}",
        "{% for i in range(3000) %}{% for j in range(3000) %}12345678{% endfor %}{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}{% endfor %}"
        "{% endfor %}",
    ],
    ids=[
        "division",
        "types",
        "recursion",
        "range",
        "repetition",
        "endless output",
        "silent loops",
        "text loops",
    ],
)
def test_a_template_failing_in_any_way_is_a_one_line_error_naming_the_file(text):
    """A file's template may divide by zero, recurse, ask for a range or a string of any size, or write
    tens of MB: each is a ValueError naming the file (no traceback, no memory taken first)."""
    with pytest.raises(ValueError, match="^m.gguf: cannot render: ") as caught:
        ChatTemplate(text, source="m.gguf").render([{"role": "user", "content": "x" * 2000}])
    assert "\n" not in str(caught.value)


def test_a_templates_loops_are_held_to_max_loop_steps_a_render():
    """Loops writing nothing, nested over ranges or the request's text, stop at MAX_LOOP_STEPS steps in
    all (each render its own count); loop.length and loop.last still see the whole sequence."""
    count = "{% for m in messages %}{% for c in m.content %}{% if loop.last %}{{ loop.length }}{% endif %}"
    template = ChatTemplate(count + "{% endfor %}{% endfor %}", source="m.gguf")
    within = MAX_LOOP_STEPS - 1  # the message is one step
    for _ in range(2):
        assert template.render([{"role": "user", "content": "x" * within}]) == str(within)
    with pytest.raises(ValueError, match=f"^m.gguf: cannot render: its loops pass {MAX_LOOP_STEPS} steps$"):
        template.render([{"role": "user", "content": "x" * (within + 1)}])


def test_template_errors_name_the_source():
    with pytest.raises(ValueError, match="^m.gguf: cannot compile the chat template"):
        ChatTemplate("{% for %}", source="m.gguf")
    raising = ChatTemplate("{{ raise_exception('only user turns') }}", source="m.gguf")
    with pytest.raises(ValueError, match="^m.gguf: cannot render: only user turns"):
        raising.render([{"role": "user", "content": "x"}])


def test_unknown_roles_are_refused(tokenizer):
    with pytest.raises(ValueError, match="chat message 1: role must be one of system, user, assistant, tool"):
        ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": "a"}, {"role": "robot"}])
