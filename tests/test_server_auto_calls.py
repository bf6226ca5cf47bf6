"""tool_choice auto (the default with tools): the text is free until the model opens a tool-call section,
then the section is held to the request's tools (a lazy grammar), so a call the model opens on its own
is one to run. The real `openai` client against `k3stream serve` on the tiny random Kimi-K3 GGUF of
test_server_tools.py, sampled at temperature 1 over many seeds; random weights seldom open a section,
so a `logit_bias` on its opening token makes them open one in most answers, at any point."""

from __future__ import annotations

import httpx
import openai
import pytest

from k3stream.server.grammar import MAX_PARALLEL_CALLS
from k3stream.server.schemas import ChatCompletionRequest
from test_server_tools import (  # noqa: F401 (client, serve, served, tool_gguf: fixtures)
    ASK,
    SCHEMAS,
    TOOLS,
    chat,
    check_call,
    client,
    held_apart,
    serve,
    served,
    stream_chat,
    tool_gguf,
    written_pieces,
)

SECTION = "<|tool_calls_section_begin|>"
SEEDS = range(24)
MAX_TOKENS = 400  # room for a section of MAX_PARALLEL_CALLS calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pushed(model, **fields) -> dict:
    """A sampled chat request with TOOLS (no tool_choice: auto) whose model is pushed to open a section."""
    section = model.tokenizer.token_id(SECTION)
    bias = {"logit_bias": {str(section): 3}}
    return {"tools": TOOLS, "temperature": 1.0, "max_tokens": MAX_TOKENS, **bias, **fields}


def token_bytes(choice) -> list[bytes]:
    return [bytes(entry.bytes) for entry in choice.logprobs.content]


@pytest.mark.parametrize("parallel", [None, False])
def test_a_section_the_model_opens_holds_calls_that_validate(client, served, parallel):  # noqa: F811
    """Whenever the answer opens a section, it holds well-formed calls of the request's tools (one where
    parallel_tool_calls is false, numbered as Kimi numbers them) whose arguments validate against their
    schema, and it is the calls to run: finish_reason `tool_calls`. Without the section's grammar the
    random model writes noise after the opening."""
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    opened = 0
    for seed in SEEDS:
        choice = chat(client, **pushed(served, seed=seed, logprobs=True, **fields)).choices[0]
        if SECTION.encode() not in token_bytes(choice):
            assert not choice.message.tool_calls
            continue
        opened += 1
        assert choice.finish_reason == "tool_calls", (seed, choice)
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= (1 if parallel is False else MAX_PARALLEL_CALLS)
        for index, call in enumerate(calls):
            check_call(call, names=tuple(SCHEMAS))
            assert call.id.endswith(f":{index}")
    assert opened >= len(SEEDS) // 2, "the bias seldom opened a section"


def test_a_held_call_streams_as_the_whole_answer_gives_it(client, served):  # noqa: F811
    """Streamed, the held calls come as `delta.tool_calls` entries whose arguments grow and join into
    the whole answer's, with the same finish reason (the same seed: the same tokens)."""
    streamed_calls = 0
    for seed in SEEDS[:6]:
        fields = pushed(served, seed=seed)
        whole = chat(client, **fields).choices[0]
        chunks = stream_chat(client, **fields)
        joined: dict[int, list[str]] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = joined.setdefault(delta.index, ["", "", ""])
                entry[0] += delta.id or ""
                entry[1] += delta.function.name or ""
                entry[2] += delta.function.arguments or ""
        calls = [[c.id, c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]
        assert list(joined.values()) == calls
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
        streamed_calls += len(calls)
    assert streamed_calls > 0


def unconstrained_tokens(model, fields: dict) -> list[bytes]:
    """The tokens the engine samples for the chat request of `fields` (ASK's) with no constraint at all,
    each step as the scheduler takes one (choose, then accept)."""
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})
    prompt = held_apart(model.prepare_chat(request))
    logic = model.new_sequence(request, prompt.tokens, fields["max_tokens"], chat=prompt)
    state = model.model.new_state()
    logits = model.model.prefill_last(state, prompt.tokens)
    while True:
        token = logic.choose(logits)
        logic.accept(token)
        if logic.sequence.done:
            return [model.tokenizer.piece(t) for t in logic.sequence.token_ids]
        logits = model.model.decode(state, token)


@pytest.mark.parametrize("with_tools", [False, True])
def test_sampling_is_free_until_a_section_opens(client, served, with_tools):  # noqa: F811
    """Without tools an answer is the engine's own draw, token for token; with tools (auto) it is that
    draw up to the section's opening, nothing computed or masked before: the grammar holds only what
    follows."""
    for seed in SEEDS[:6]:
        fields = pushed(served, seed=seed, max_tokens=60)
        if not with_tools:
            fields.pop("tools")
        served_tokens = token_bytes(chat(client, logprobs=True, **fields).choices[0])
        free = unconstrained_tokens(served, fields)
        opened = served_tokens.index(SECTION.encode()) + 1 if SECTION.encode() in served_tokens else None
        assert served_tokens[:opened] == free[:opened]
        assert with_tools or served_tokens == free


def auto_logic(model):
    """The request logic of ASK with TOOLS under tool_choice auto, as the server makes it."""
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS})
    prompt = model.prepare_chat(request)
    return model.new_sequence(request, prompt.tokens, 200, chat=prompt)


def write(model, logic, text: str) -> None:
    """Feed `text` to `logic` as the model's tokens."""
    for token in model.tokenizer.encode(text, allow_special=True, add_bos=False):
        logic.accept(token)


def test_a_section_token_inside_the_think_block_is_reasoning_and_holds_nothing(served):  # noqa: F811
    """The parser takes a section's opening inside the think block for reasoning text, so the grammar
    holds nothing there; after the block the same token opens a held section: its first call next."""
    logic = auto_logic(served)
    write(served, logic, f"<think>Call?{SECTION}")
    assert logic.constraint.allowed() is None
    write(served, logic, f"</think>Yes.{SECTION}")
    allowed = logic.constraint.allowed()
    assert allowed.nonzero().flatten().tolist() == [served.tokenizer.token_id("<|tool_call_begin|>")]


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# a string pattern llguidance cannot compile (a lookbehind)
LOOKBEHIND = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}
REFUSED = {
    "parameters of another type than object": (function("f", {"type": "string"}), "must be a JSON Schema"),
    "a pattern the grammar library cannot compile": (function("f", LOOKBEHIND), "cannot be compiled"),
}


@pytest.mark.parametrize("tool, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_tool_the_section_cannot_hold_is_a_400_naming_it(serve, tool, message):  # noqa: F811
    body = {"messages": ASK, "max_tokens": 4, "tools": [*TOOLS, tool]}
    response = httpx.post(serve.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools.2.function.parameters" and message in error["message"]


def test_a_keyword_llguidance_does_not_implement_is_left_to_the_calls_check(client, served):  # noqa: F811
    """`uniqueItems`: a forced call's grammar refuses it (a 400); a section the model opens holds the rest
    of the schema, and the finished call is checked against the whole (`test_kimi_output.py`)."""
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tools = [*TOOLS, function("tag", unique)]
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "tag"}})
    answer = chat(client, **pushed(served, seed=0, tools=tools))
    assert answer.choices[0].finish_reason in ("stop", "tool_calls", "length")


OPENING = f"{SECTION}<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"


def test_a_held_call_keeps_the_models_json_layout_within_bounds(served):  # noqa: F811
    """Line breaks and indentation stay the model's (the forced grammar's compact JSON would refuse
    them), but no run of whitespace goes on: after four spaces no token may add a fifth."""
    logic = auto_logic(served)
    laid_out = '{\n  "city": "Paris",\n  "days": 2\n}'
    written = f"{OPENING}{laid_out}<|tool_call_end|><|tool_calls_section_end|>"
    pieces = written_pieces(served, logic, written)
    assert logic.finish_reason == "tool_calls"
    assert "".join(call.arguments for piece in pieces for call in piece.tool_calls) == laid_out
    padded = auto_logic(served)
    write(served, padded, f"{OPENING}{{    ")
    allowed = padded.constraint.allowed().nonzero().flatten().tolist()
    assert allowed and not any(served.tokenizer.piece(t)[:1] in (b" ", b"\t") for t in allowed)
