"""A tool call the answer ends inside (the end-of-sequence token or a stop string within its arguments),
or whose arguments end but are no JSON object, is an unfinished call on every API, streamed and whole
alike: sent as it came, never as a call to run (`finish_reason` `stop`, `stop_reason` not `tool_use`, a
call item of `status` `incomplete`). The model writes the answers through the server's whole path on
127.0.0.1 (`Scripted`: random weights never call a tool of their own accord), or a forced call is cut by a
stop string; the `openai` and `anthropic` clients read them."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from k3stream.server.messages import _object_so_far
from live_server import cached_served, keyed_server
from test_server_messages import Scripted
from test_server_tools import WEATHER, tool_gguf  # noqa: F401 (tool_gguf: a fixture, the tool-calling chat model)

KEY = "sk-unfinished"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
MESSAGES_TOOL = {"name": "get_weather", "input_schema": WEATHER}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
HEADER = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
# the arguments the model writes, then its end-of-sequence token
UNFINISHED = {
    "the end inside the arguments": '{"city": "Paris", "da',
    "the end after an object without the call's end": '{"city": "Paris"}',
    "arguments that end but are no object": '{"city": "Paris"]<|tool_call_end|><|tool_calls_section_end|>',
}
FINISHED = '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tool_gguf):  # noqa: F811
    yield from cached_served(tool_gguf, "tiny-unfinished", ctx=1024)


@pytest.fixture(scope="module")
def server(served):
    with keyed_server(served, KEY, max_batch=2) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def writes(served, monkeypatch):
    """Makes the model write `arguments` after a call header, then its end-of-sequence token."""

    def write(arguments: str) -> None:
        tokens = served.tokenizer.encode(HEADER + arguments, allow_special=True, add_bos=False)
        scripted = lambda *_: Scripted(tokens, served.grammars.stop_ids, served.vocab_size)  # noqa: E731
        monkeypatch.setattr(served, "_constraint", scripted)

    return write


def chat_answers(client, **fields):
    """The whole chat answer and the streamed one added up: (finish reason, [(id, name, arguments)])."""
    request = {"model": "m", "messages": ASK, "tools": [CHAT_TOOL], "max_tokens": 60, "temperature": 0}
    whole = client.chat.completions.create(**request, **fields).choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    streamed: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**request, **fields, stream=True):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                entry = streamed.setdefault(call.index, ["", "", ""])
                entry[0] += call.id or ""
                entry[1] += (call.function.name or "") if call.function else ""
                entry[2] += (call.function.arguments or "") if call.function else ""
    assert [tuple(entry) for entry in streamed.values()] == calls
    assert reason == whole.finish_reason
    return whole.finish_reason, calls


def message_answers(claude, **fields):
    """The whole message and the one the `anthropic` client builds from the stream: (stop reason,
    content blocks), the same in both."""
    request = {"model": "m", "max_tokens": 60, "messages": ASK, "tools": [MESSAGES_TOOL]}
    request["extra_body"] = {"temperature": 0}  # a field this version of the client no longer names
    whole = claude.messages.create(**request, **fields)
    with claude.messages.stream(**request, **fields) as stream:
        streamed = stream.get_final_message()
    blocks = [block.model_dump(exclude_none=True) for block in whole.content]
    assert [block.model_dump(exclude_none=True) for block in streamed.content] == blocks
    assert streamed.stop_reason == whole.stop_reason
    return whole.stop_reason, blocks


def response_answers(client, **fields):
    """The whole response and the one the stream's last event carries: (status, [(type, status,
    arguments)] of the output items), the same in both."""
    request = {"model": "m", "input": ASK, "tools": [RESPONSES_TOOL], "max_output_tokens": 60}
    whole = client.responses.create(**request, temperature=0, **fields)
    last = list(client.responses.create(**request, temperature=0, stream=True, **fields))[-1]
    items = [(i.type, i.status, getattr(i, "arguments", None)) for i in whole.output]
    assert last.type == f"response.{whole.status}"
    assert [(i.type, i.status, getattr(i, "arguments", None)) for i in last.response.output] == items
    return whole.status, items


@pytest.mark.parametrize("arguments", UNFINISHED.values(), ids=UNFINISHED.keys())
def test_an_unfinished_call_is_sent_as_it_came_and_never_as_a_call_to_run(client, claude, writes, arguments):
    writes(arguments)
    written = arguments.split("<|tool_call_end|>")[0]
    reason, calls = chat_answers(client)
    assert reason == "stop"
    assert calls == [("functions.get_weather:0", "get_weather", written)]
    stop_reason, blocks = message_answers(claude)
    assert stop_reason == "end_turn"
    input_so_far = _object_so_far(written)
    assert blocks == [
        {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": input_so_far}
    ]
    status, items = response_answers(client)
    assert (status, items) == ("completed", [("function_call", "incomplete", written)])


def test_a_finished_call_is_a_call_to_run_on_every_api(client, claude, writes):
    writes(FINISHED)
    written = FINISHED.split("<|tool_call_end|>")[0]
    assert chat_answers(client) == ("tool_calls", [("functions.get_weather:0", "get_weather", written)])
    stop_reason, blocks = message_answers(claude)
    assert stop_reason == "tool_use" and blocks[0]["input"] == json.loads(written)
    assert response_answers(client) == ("completed", [("function_call", "completed", written)])


@pytest.mark.parametrize("stop", ['"', '":', ","])
def test_a_stop_string_inside_a_forced_calls_arguments_leaves_it_unfinished(client, claude, stop):
    """A forced call (its grammar admits no end inside the arguments) cut by a stop string in them: its
    arguments are the text before the stop string, no JSON, and the answer is no call to run."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    _, (whole_call,) = chat_answers(client, tool_choice=forced)
    cut = whole_call[2][: whole_call[2].index(stop)]
    reason, calls = chat_answers(client, tool_choice=forced, stop=[stop])
    assert (reason, calls) == ("stop", [(*whole_call[:2], cut)])
    stop_reason, blocks = message_answers(
        claude, tool_choice={"type": "tool", "name": "get_weather"}, stop_sequences=[stop]
    )
    assert stop_reason == "stop_sequence"
    assert [(b["type"], b["input"]) for b in blocks] == [("tool_use", _object_so_far(cut))]
