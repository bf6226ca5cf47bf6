"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the real `anthropic`
client against the server on 127.0.0.1, answered as the same conversation sent to `/v1/chat/completions`
(the real `openai` client) is: a tiny random Kimi-K3 GGUF carrying Kimi-K2's tool template and `<think>`
tokens, with a prompt cache. Random weights never choose to call a tool, so calls are forced with
`tool_choice` (constrained decoding)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from k3stream.server.messages import MessageShapes, MessagesRequest, _object_so_far
from k3stream.server.request_logic import RequestLogic
from k3stream.server.scheduler import Job
from live_server import assert_answers_while_held, cached_served, keyed_server, sse_events
from test_server_tools import WEATHER, held_apart, tool_gguf, written_pieces  # noqa: F401 (tool_gguf: a fixture, the tool-calling chat model)

KEY = "sk-messages"
TOOL = {"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}
OPENAI_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
}
FORCED = {"type": "tool", "name": "get_weather"}
SYSTEM = "You answer briefly."
ASK = "What is the weather in Paris?"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tool_gguf):  # noqa: F811
    yield from cached_served(tool_gguf, "tiny-messages", ctx=1024)


@pytest.fixture(scope="module")
def server(served):
    with keyed_server(served, KEY, max_batch=2) as thread:
        yield thread


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(claude, sampling=None, **fields):
    """A message to `claude`; `sampling` (greedy unless given): temperature, top_p, top_k, which this
    version of the client no longer names, in the body as older clients and agents send them."""
    request = {"model": "claude-any", "max_tokens": 12, "system": SYSTEM}
    messages = [{"role": "user", "content": ASK}]
    body = sampling or {"temperature": 0}
    return claude.messages.create(**{**request, "messages": messages, **fields}, extra_body=body)


def chat(openai_client, **fields):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    request = {"model": "any-name", "max_tokens": 12, "temperature": 0, "messages": messages}
    return openai_client.chat.completions.create(**{**request, **fields})


def post(server, path, body, key=KEY):
    return httpx.post(server.url + path, json=body, headers={"x-api-key": key}, timeout=120)


def test_a_message_is_answered_as_the_chat_completion_of_the_same_conversation(claude, openai_client, served):
    message = ask(claude)
    answer = chat(openai_client)
    choice = answer.choices[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == served.name  # whatever name was asked, the served model answers
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice.message.content != ""
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == answer.usage.prompt_tokens
    assert usage.output_tokens == answer.usage.completion_tokens
    beta = claude.beta.messages.create(  # `POST /v1/messages?beta=true`, as Claude Code sends it
        model="claude-any",
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        extra_body={"temperature": 0},
    )
    assert beta.content[0].text == message.content[0].text


def test_the_prompt_cache_shows_as_cache_read_input_tokens(claude):
    question = [{"role": "user", "content": "Tell me about the sea and the mountains of Peru."}]
    first = ask(claude, messages=question)
    again = ask(claude, messages=question)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.content == first.content  # the restored state answers as the computed one


def test_a_stream_is_anthropics_event_sequence_and_adds_up_to_the_whole_message(claude, server):
    whole = ask(claude, max_tokens=10)
    events = list(ask(claude, max_tokens=10, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == [
        "content_block_start",
        *["content_block_delta"] * (len(kinds) - 5),
        "content_block_stop",
    ]
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens > 0
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert len(kinds) > 6 and text == whole.content[0].text  # streamed as it grew
    assert events[-2].delta.stop_reason == whole.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 10
    messages = [{"role": "user", "content": ASK}]
    request = {"model": "x", "max_tokens": 10, "system": SYSTEM, "messages": messages}
    with claude.messages.stream(**request, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    raw = httpx.post(
        server.url + "/v1/messages",
        json={"max_tokens": 3, "messages": [{"role": "user", "content": ASK}], "stream": True},
        headers={"x-api-key": KEY},
        timeout=120,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [frame for frame in raw.text.split("\n\n") if frame]
    assert all(frame.startswith("event: ") and "\ndata: {" in frame for frame in frames), frames
    assert "[DONE]" not in raw.text


def test_a_forced_tool_use_is_a_tool_use_block_and_streams_as_input_json_deltas(claude):
    message = ask(claude, max_tokens=120, tools=[TOOL], tool_choice=FORCED)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER)
    events = list(ask(claude, max_tokens=120, tools=[TOOL], tool_choice=FORCED, stream=True))
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [(b.type, b.id, b.name) for b in starts] == [("tool_use", block.id, "get_weather")]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(partial) > 1 and json.loads("".join(partial)) == block.input
    assert events[-2].delta.stop_reason == "tool_use"


def _block(block) -> dict:
    if block.type == "text":
        return {"type": "text", "text": block.text}
    return {"type": block.type, "id": block.id, "name": block.name, "input": block.input}


def test_a_call_cut_off_by_max_tokens_is_the_same_block_streamed_and_whole(claude):
    """A forced call that `max_tokens` cuts inside its arguments is, as Anthropic's API answers it, a
    `tool_use` block whose `input` holds the members written whole, streamed (as the `anthropic` client
    reads the deltas) and whole alike, `stop_reason` `max_tokens`; cut before its arguments began, the
    call with an empty input once its header names the tool, never text (the section's markup)."""
    request = {"tools": [TOOL], "tool_choice": FORCED}
    full = ask(claude, max_tokens=120, **request)
    (call,) = full.content
    inputs = []
    for max_tokens in range(1, full.usage.output_tokens):
        whole = ask(claude, max_tokens=max_tokens, **request)
        asked = {"model": "x", "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]}
        with claude.messages.stream(
            max_tokens=max_tokens, extra_body={"temperature": 0}, **asked, **request
        ) as stream:
            streamed = stream.get_final_message()
        assert whole.stop_reason == streamed.stop_reason == "max_tokens"
        assert [_block(b) for b in whole.content] == [_block(b) for b in streamed.content]
        assert [b.type for b in whole.content] in ([], ["tool_use"])
        if whole.content:
            assert (whole.content[0].id, whole.content[0].name) == (call.id, call.name)
            assert whole.content[0].input.items() <= call.input.items()
            inputs.append(whole.content[0].input)
    assert {} in inputs and any(0 < len(cut) < len(call.input) for cut in inputs), inputs


def test_a_cut_calls_input_is_what_the_anthropic_client_reads_from_the_deltas():
    """The input of a call cut off after any character of its arguments is what the `anthropic` client
    reads from the same text streamed (jiter's partial mode, its own dependency)."""
    from jiter import from_json

    arguments = (
        '{"city": "Paris", "days": 12, "tags": ["a,b", {"c": null, "d": [1.5e3, true, -2]}], '
        '"q": "say \\"}{\\" \\\\", "empty": {}, "nested": [[1], [2, [3]]]}'
    )
    assert json.loads(arguments)["q"] == 'say "}{" \\'
    for end in range(1, len(arguments) + 1):
        cut = arguments[:end]
        assert _object_so_far(cut) == from_json(cut.encode(), partial_mode=True), cut


def test_a_tool_result_turn_is_the_chat_conversation_with_the_tool_message(
    claude, openai_client, server, served
):
    call = ask(claude, max_tokens=120, tools=[TOOL], tool_choice=FORCED).content[0]
    result = '{"forecast": "sunny", "high": 21}'
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": result}]}
            ],
        },
    ]
    message = ask(claude, messages=messages, tools=[TOOL], max_tokens=8)
    arguments = json.dumps(call.input, separators=(",", ":"))
    openai_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = chat(openai_client, messages=openai_messages, tools=[OPENAI_TOOL], max_tokens=8)
    assert message.content[0].text == answer.choices[0].message.content
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt == answer.usage.prompt_tokens
    counted = claude.messages.count_tokens(model="any", system=SYSTEM, messages=messages, tools=[TOOL])
    assert counted.input_tokens == prompt
    rendered = served.chat_template.render(
        [{**m, "content": m["content"] or ""} for m in openai_messages], tools=[OPENAI_TOOL]
    )
    assert f"## Return of {call.id}\n{result}" in rendered


class Scripted:
    """A constraint that lets the model write `tokens`, then only stop: an answer as Kimi writes it (random
    weights never call a tool of their own accord), taken through the server's whole path."""

    def __init__(self, tokens: list[int], stops: list[int], vocab_size: int) -> None:
        self.tokens = tokens
        self.stops = stops
        self.vocab_size = vocab_size
        self.written = 0

    def allowed(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.tokens[self.written : self.written + 1] or self.stops] = True
        return allowed

    def advance(self, token: int) -> None:
        self.written += 1


def written_answer(claude, served, monkeypatch, text: str, **fields):
    """The message answering `fields` (`ask`'s) whose answer the model writes as `text`."""
    tokens = served.tokenizer.encode(text, allow_special=True, add_bos=False)

    def scripted(*_: object) -> Scripted:  # in place of `ServedModel._constraint`
        return Scripted(tokens, served.grammars.stop_ids, served.vocab_size)

    with monkeypatch.context() as patch:
        patch.setattr(served, "_constraint", scripted)
        return ask(claude, **fields)


# answers as the model writes them: (reasoning, text, the call's arguments with the whitespace around them)
WRITTEN_ANSWERS = {
    "a call": ("", "", '{"city": "Paris", "days": 2}'),
    "reasoning, text and a call in spaces": (
        "Paris, then.",
        "Let me check.\n",
        ' {"city": "Paris", "days": 2}\n',
    ),
}


@pytest.mark.parametrize("answer", WRITTEN_ANSWERS.values(), ids=WRITTEN_ANSWERS.keys())
def test_a_tool_use_sent_back_restores_the_answer_past_the_call(claude, served, monkeypatch, answer):
    """A `tool_use` block's `input` is an object, which the conversion writes as compact JSON, where Kimi
    writes `{"city": "Paris", "days": 2}` (here with the blocks of its reasoning and text before it, and
    whitespace around the arguments, which the block leaves out): the server writes the arguments the
    model wrote (the same JSON value), so the turn after the call restores the answer's cached state
    and computes only the tool result and what follows it."""
    reasoning, text, arguments = answer
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{arguments}<|tool_call_end|><|tool_calls_section_end|>"
    )
    thinking = {"thinking": {"type": "enabled"}} if reasoning else {}
    asked = {"tools": [TOOL], **thinking}
    question = [{"role": "user", "content": "Which weather will Paris have?"}]
    written = f"{reasoning}</think>{text}{call}" if reasoning else text + call
    first = written_answer(claude, served, monkeypatch, written, messages=question, max_tokens=80, **asked)
    *before, block = first.content
    assert (block.type, block.input, first.stop_reason) == ("tool_use", json.loads(arguments), "tool_use")
    assert [b.thinking if b.type == "thinking" else b.text for b in before] == [
        t for t in (reasoning, text) if t
    ]
    history = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
    ]
    second = ask(claude, messages=history, max_tokens=4, **asked)
    usage = first.usage
    # the answer's state, all but its last token (never fed to the model)
    answered = usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens == answered
    sent = {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
    assistant = {"role": "assistant", "content": text, "reasoning_content": reasoning, "tool_calls": [sent]}
    rendered = served.chat_template.render(
        [
            {"role": "system", "content": SYSTEM},
            *question,
            assistant,
            {"role": "tool", "tool_call_id": block.id, "content": "sunny"},
        ],
        tools=[OPENAI_TOOL],
        thinking=bool(reasoning),
    )
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt == len(served.tokenizer.encode(rendered, allow_special=True))


def test_a_stop_sequence_ends_the_answer_before_it(claude):
    text = ask(claude, max_tokens=16).content[0].text
    start = next(i for i in range(1, len(text) - 3) if text.index(text[i : i + 3]) == i)
    word = text[start : start + 3]  # three characters the answer holds first there
    message = ask(claude, max_tokens=16, stop_sequences=[word])
    assert message.content[0].text == text[:start]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)


def filling_question(claude):
    """A user message whose prompt leaves at most 8 tokens of the context (1024), and the room it leaves."""
    words = 1
    while True:
        messages = [{"role": "user", "content": "sea " * words}]
        counted = claude.messages.count_tokens(model="x", system=SYSTEM, messages=messages).input_tokens
        if counted >= 1024 - 8:
            assert counted < 1024, "the padding overshot the context: choose another word"
            return messages, 1024 - counted
        words += max((1024 - 8 - counted) // 4, 1)


def test_max_tokens_past_the_context_stops_where_the_context_is_full(claude):
    """Claude Code asks for 32000 tokens whatever the prompt: as llama-server does, the answer runs to
    the context's end, where Anthropic's API says `model_context_window_exceeded`."""
    messages, room = filling_question(claude)
    message = ask(claude, max_tokens=32000, messages=messages)
    assert (message.stop_reason, message.usage.output_tokens) == ("model_context_window_exceeded", room)
    events = list(ask(claude, max_tokens=32000, messages=messages, stream=True))
    assert events[-2].delta.stop_reason == "model_context_window_exceeded"
    assert events[-2].usage.output_tokens == room
    asked_exactly = ask(claude, max_tokens=room, messages=messages)
    assert asked_exactly.stop_reason == "max_tokens"
    assert asked_exactly.content == message.content


def test_top_k_one_draws_the_greedy_answer(claude):
    greedy = ask(claude, max_tokens=8)
    drawn = ask(claude, {"temperature": 1.0, "top_k": 1, "top_p": 1.0}, max_tokens=8)
    assert drawn.content == greedy.content


def test_thinking_opens_the_think_block_and_the_reasoning_is_a_thinking_block(claude, openai_client):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    plain = claude.messages.count_tokens(model="x", messages=[{"role": "user", "content": ASK}])
    opened = claude.messages.count_tokens(
        model="x", messages=[{"role": "user", "content": ASK}], thinking=thinking
    )
    assert opened.input_tokens == plain.input_tokens + 1  # the template's `<think>`
    message = ask(claude, max_tokens=6, thinking=thinking)
    reasoning = chat(openai_client, max_tokens=6, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == reasoning.choices[0].message.reasoning_content
    events = list(ask(claude, max_tokens=6, thinking=thinking, stream=True))
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == message.content[0].thinking
    assert [d.type for d in deltas][-1] == "signature_delta"  # a thinking block ends with its signature
    assert [
        (e.type, e.index)
        for e in events
        if e.type.startswith("content_block_") and e.type != "content_block_delta"
    ] == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
    ]


@pytest.mark.parametrize(
    ("body", "status", "kind", "named"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
        (
            {"max_tokens": 2.5, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages.0.content.0.type",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}
                ],
            },
            400,
            "invalid_request_error",
            "messages.0.content.0.type",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": {"type": 5}}],
            },
            400,
            "invalid_request_error",
            "tools.0.input_schema",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]},
            400,
            "invalid_request_error",
            "stop_sequences",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "any"},
            },
            400,
            "invalid_request_error",
            'tool_choice: {"type": "any"} needs at least one tool',
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
                "tool_choice": {"type": "any"},
            },
            400,
            "invalid_request_error",
            "tools.0.input_schema",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 1100}]},
            400,
            "invalid_request_error",
            "context",
        ),
    ],
)
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, status, kind, named):
    response = post(server, "/v1/messages", body)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind and named in error["error"]["message"], error


def test_a_wrong_key_a_body_too_large_and_a_wrong_method_are_anthropic_errors(server, claude):
    refused = post(
        server,
        "/v1/messages",
        {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        key="wrong",
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error" and refused.json()["type"] == "error"
    huge = post(
        server, "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    )
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    get = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=10)
    assert get.status_code == 405 and get.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="x", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def _thinking_answer(served, written: str, *, held: bool = True) -> tuple[MessageShapes, RequestLogic, list]:
    """The message shapes and request logic of ASK with TOOL and thinking on, and the pieces the logic
    makes of `written` as the model's tokens; not `held`: with no grammar (`held_apart`)."""
    body = {"max_tokens": 100, "tools": [TOOL], "thinking": {"type": "enabled"}}
    chat = MessagesRequest.model_validate(
        {**body, "messages": [{"role": "user", "content": ASK}]}
    ).chat_request()
    prompt = served.prepare_chat(chat)
    prompt = prompt if held else held_apart(prompt)
    logic = served.new_sequence(chat, prompt.tokens, 100, chat=prompt)
    shapes = MessageShapes(Job(prompt_tokens=prompt.tokens, logic=logic, sink=None), served.name, 100)
    return shapes, logic, written_pieces(served, logic, written)


def _stream(shapes: MessageShapes, pieces: list, finish_reason: str | None) -> str:
    """The events a message streams for `pieces`, to its end."""
    return "".join(shapes.piece(piece) for piece in pieces) + shapes.last(finish_reason)


def test_reasoning_text_and_a_call_the_model_writes_are_three_blocks_in_order(served):
    """An answer as Kimi writes it (the think block the prompt opened, text, a tool call), taken token by
    token by the request's own logic as the scheduler feeds it: three blocks, each stopped before the next
    starts, whose deltas add up to the whole message's blocks."""
    written = (
        "Paris, so the forecast.</think>Let me check."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
    )
    shapes, logic, pieces = _thinking_answer(served, written)
    stream = _stream(shapes, pieces, logic.finish_reason)
    events = sse_events(stream)
    assert stream.count("event: ") == len(events)
    blocks = [
        (e["type"], e["index"]) for e in events if e["type"] in ("content_block_start", "content_block_stop")
    ]
    assert blocks == [
        (kind, index) for index in range(3) for kind in ("content_block_start", "content_block_stop")
    ]
    whole = shapes.whole_choice(pieces, logic.finish_reason)
    assert [block["type"] for block in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["stop_reason"] == "tool_use" == events[-2]["delta"]["stop_reason"]
    for index, (block, field) in enumerate(
        zip(whole["content"], ("thinking", "text", "partial_json"), strict=True)
    ):
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == index]
        streamed = "".join(delta.get(field, "") for delta in deltas)
        assert (json.loads(streamed) if field == "partial_json" else streamed) == block.get(
            field, block.get("input")
        )
    assert whole["content"][2]["input"] == {"city": "Paris", "days": 2}
    assert (
        whole["content"][0]["thinking"] == "Paris, so the forecast."
        and whole["content"][1]["text"] == "Let me check."
    )


def test_text_written_after_a_call_follows_it_in_the_whole_message_as_in_the_stream(served):
    """Reasoning, a tool call, then text (where no grammar holds the section: `held_apart`): the whole
    message's blocks are the streamed ones, in the order the stream started them (the call before the
    text)."""
    written = (
        "Paris.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
        "It is on its way."
    )
    shapes, logic, pieces = _thinking_answer(served, written, held=False)
    stream = _stream(shapes, pieces, logic.finish_reason)
    events = sse_events(stream)
    started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert started == ["thinking", "tool_use", "text"]
    whole = shapes.whole_choice(pieces, logic.finish_reason)
    assert [block["type"] for block in whole["content"]] == started
    assert whole["content"][1]["input"] == {"city": "Paris", "days": 2}
    assert whole["content"][2]["text"] == "It is on its way."


@pytest.mark.parametrize(
    ("path", "stage"),
    [
        ("/v1/messages", "object_tool"),  # the conversion into the chat request
        ("/v1/messages", "check_supported"),  # the chat request's own checks
        ("/v1/messages/count_tokens", "object_tool"),
        ("/v1/chat/completions", "check_supported"),
    ],
)
def test_the_tools_are_converted_and_checked_off_the_event_loop(server, monkeypatch, path, stage):
    """A request's tools (each JSON Schema checked, 2 ms each on this machine, and an agent sends hundreds:
    400 here) are converted and checked on the tokenizer threads: the server answers others meanwhile.
    Each stage is held until /health has answered."""
    import k3stream.server.messages as messages
    from k3stream.server.schemas import ChatCompletionRequest

    owner = messages if stage == "object_tool" else ChatCompletionRequest
    tools = [{**TOOL, "name": f"get_weather_{number}"} for number in range(400)]
    if path == "/v1/chat/completions":
        tools = [
            {"type": "function", "function": {**OPENAI_TOOL["function"], "name": t["name"]}} for t in tools
        ]
    body = {"max_tokens": 1, "tools": tools, "messages": [{"role": "user", "content": ASK}]}
    headers = {"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}
    send = lambda: httpx.post(server.url + path, json=body, headers=headers, timeout=120)  # noqa: E731
    assert_answers_while_held(server, monkeypatch, owner, stage, send)


def test_a_messages_text_blocks_reach_the_template_as_chats_text_parts(claude, openai_client):
    """llama-server turns a message's text blocks into chat's text parts, which reach the template with a
    line break between two; they were joined with nothing (`Tell me` `about the sea.` prompted as
    `Tell meabout the sea.`). A run of text blocks after a tool result is still a user message of its own."""
    texts = ["Tell me", "about the sea."]
    blocks = [{"type": "text", "text": text} for text in texts]
    message = ask(claude, messages=[{"role": "user", "content": blocks}])
    joined = chat(
        openai_client,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(texts)}],
    )
    assert message.content[0].text == joined.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == joined.usage.prompt_tokens
    request = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [*blocks, {"type": "tool_result", "tool_use_id": "t"}, *blocks]},
            ],
        }
    )
    user = request.messages[1].chat_messages(1)
    assert [(m.role, m.content) for m in user] == [
        ("user", "\n".join(texts)),
        ("tool", ""),
        ("user", "\n".join(texts)),
    ]
