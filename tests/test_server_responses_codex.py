"""`/v1/responses` as OpenAI's Codex CLI uses it (a custom model provider with wire_api "responses"):
its request body, its freeform `custom` tools (apply_patch's Lark grammar) and its hosted tools, through
the real server on 127.0.0.1, with the real `openai` client or raw httpx. The model is the tiny random
Kimi-K3 GGUF of tests/test_server_responses.py; calls are forced with `tool_choice`."""

from __future__ import annotations

import copy
import json
import logging
import re

import lark
import pytest
import torch

from k3stream.server.grammar import MAX_GRAMMAR_CHARS
from k3stream.server.kimi_output import Piece
from k3stream.server.responses import ResponsesRequest
from live_server import sse_events
from test_server_responses import KEY, client, post, served, server  # noqa: F401 (fixtures)
from test_server_tools import tool_gguf  # noqa: F401 (a fixture, the tool-calling chat model)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# codex-rs/core/src/tools/handlers/apply_patch.rs (tool_apply_patch.lark): the grammar Codex sends
APPLY_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello, world!\n*** End Patch\n"
SHELL_OUTPUT = '{"output":"README.md\\nsrc\\n","metadata":{"exit_code":0,"duration_seconds":0.1}}'


def codex_request() -> dict:
    """A second turn of a Codex session, as Codex serializes it: the fields of `ResponsesApiRequest`
    (codex-rs/codex-api/src/common.rs), the tools of codex-rs/core/src/tools/spec.rs (`shell`,
    `update_plan`, `view_image`, `web_search`) and the freeform `apply_patch` of
    codex-rs/core/src/tools/handlers/apply_patch.rs, and the history items of
    codex-rs/protocol/src/models.rs (`ResponseItem`: ids are not sent; a reasoning item with only
    `encrypted_content`; a shell call and its output; an apply_patch `custom_tool_call` and its
    `custom_tool_call_output`)."""
    shell_parameters = {
        "type": "object",
        "properties": {
            "command": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The command to execute",
            },
            "workdir": {"type": "string", "description": "The working directory to execute the command in"},
            "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"},
        },
        "required": ["command"],
        "additionalProperties": False,
    }
    plan_item = {
        "type": "object",
        "properties": {"step": {"type": "string"}, "status": {"type": "string"}},
        "required": ["step", "status"],
        "additionalProperties": False,
    }
    plan_parameters = {
        "type": "object",
        "properties": {"explanation": {"type": "string"}, "plan": {"type": "array", "items": plan_item}},
        "required": ["plan"],
        "additionalProperties": False,
    }
    tools = [
        {
            "type": "function",
            "name": "shell",
            "description": "Runs a shell command and returns its output.",
            "strict": False,
            "parameters": shell_parameters,
        },
        {
            "type": "function",
            "name": "update_plan",
            "description": "Updates the task plan.",
            "strict": False,
            "parameters": plan_parameters,
        },
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not "
            "wrap the patch in JSON.",
            "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
        },
        {
            "type": "function",
            "name": "view_image",
            "description": "Attach a local image (by filesystem path) to the conversation context.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
        {"type": "web_search"},
    ]
    shell_call = {"command": ["bash", "-lc", "ls"], "workdir": "/repo"}
    user = {"type": "message", "role": "user"}
    history = [
        {**user, "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n"}]},
        {**user, "content": [{"type": "input_text", "text": "Add hello.txt saying hello."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-opaque"},
        {"type": "function_call", "name": "shell", "arguments": json.dumps(shell_call), "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": SHELL_OUTPUT},
        {
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "call_2",
            "name": "apply_patch",
            "input": PATCH,
        },
        {
            "type": "custom_tool_call_output",
            "call_id": "call_2",
            "output": "Exit code: 0\nOutput:\nA hello.txt\n",
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {**user, "content": [{"type": "input_text", "text": "Now list the files."}]},
    ]
    return {
        "model": "k3-local",
        "instructions": "You are Codex, a coding agent running in a terminal.",
        "input": history,
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a3c2-5e1b-7b40-9a55-1f0c1d2e3f4a",
        "text": {"verbosity": "medium"},
        "max_output_tokens": 16,  # Codex sends none; the tiny model is kept short
        "temperature": 0,
    }


def test_a_codex_request_is_answered_as_if_its_hosted_tools_were_not_sent(server, caplog):  # noqa: F811
    """Codex's whole request streams an answer; `web_search` is left out of the prompt with a warning in
    the log (the same request without it gets the same prompt and answer); every history item reaches
    the prompt (a request without the apply_patch round trip is shorter)."""
    with caplog.at_level(logging.WARNING, logger="k3stream.server.responses_tools"):
        response = post(server, codex_request())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"] and done
    assert "web_search" in caplog.text
    without_hosted = codex_request()
    without_hosted["tools"] = without_hosted["tools"][:-1]
    again = sse_events(post(server, without_hosted).text)[-1]["response"]
    final = events[-1]["response"]
    assert again["usage"]["input_tokens"] == final["usage"]["input_tokens"]
    assert again["output"][0]["content"] == final["output"][0]["content"]
    shorter = codex_request()
    shorter["input"] = shorter["input"][:5] + shorter["input"][7:]
    cut = sse_events(post(server, shorter).text)[-1]["response"]
    assert cut["usage"]["input_tokens"] < final["usage"]["input_tokens"]


def test_the_openai_client_sends_codexs_request_and_a_repeat_comes_from_the_cache(client):  # noqa: F811
    body = codex_request()
    body.pop("stream")
    extra = {name: body.pop(name) for name in ("prompt_cache_key", "text")}
    first, again = (client.responses.create(**body, extra_body=extra) for _ in range(2))
    assert first.status in ("completed", "incomplete")
    reasoning = first.output[0]  # Codex's reasoning effort turns Kimi's thinking on
    assert reasoning.type == "reasoning" and reasoning.content[0].text != ""
    assert [tool.type for tool in first.tools] == ["function", "function", "custom", "function", "web_search"]
    assert again.output[0].content == reasoning.content and again.usage.input_tokens_details.cached_tokens > 0


CALC_LARK = 'start: "x = " NUMBER " " OP " " NUMBER\nNUMBER: /[0-9]{1,3}/\nOP: "+" | "-"\n'
CALC_REGEX = "x = [0-9]{1,3} [+-] [0-9]{1,3}"


# valid grammars past MAX_GRAMMAR_CHARS (llguidance's check of a long one takes minutes), alone and as two
LONG_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_CHARS // 8))
HALF_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_CHARS // 16))


def calc_tool(syntax: str) -> dict:
    definition = CALC_LARK if syntax == "lark" else CALC_REGEX
    text_format = {"type": "grammar", "syntax": syntax, "definition": definition}
    return {"type": "custom", "name": "calc", "description": "Evaluates a sum", "format": text_format}


def forced_calc(client, syntax: str, **fields):  # noqa: F811
    request = {"model": "x", "input": "Add two numbers.", "max_output_tokens": 40, "temperature": 0}
    choice = {"type": "custom", "name": "calc"}
    return client.responses.create(**request, tools=[calc_tool(syntax)], tool_choice=choice, **fields)


def follows(syntax: str, text: str) -> bool:
    """Whether `text` is a sentence of the calc grammar, by `lark`'s own parser or Python's `re`."""
    if syntax == "regex":
        return re.fullmatch(CALC_REGEX, text) is not None
    try:
        lark.Lark(CALC_LARK, parser="earley").parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


@pytest.mark.parametrize("syntax", ["lark", "regex"])
def test_a_forced_custom_call_follows_its_grammar_streamed_and_whole(client, syntax):  # noqa: F811
    response = forced_calc(client, syntax)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "custom_tool_call" and call.name == "calc" and call.call_id == "functions.calc:0"
    assert call.id.startswith("ctc_") and follows(syntax, call.input), call.input
    events = list(forced_calc(client, syntax, stream=True))
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, item.name, item.input) for item in added] == [("custom_tool_call", "calc", "")]
    deltas = [event.delta for event in events if event.type == "response.custom_tool_call_input.delta"]
    (done,) = [event for event in events if event.type == "response.custom_tool_call_input.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.input == call.input
    assert events[-1].type == "response.completed" and events[-1].response.output[0].input == call.input


def test_a_forced_custom_call_without_a_grammar_takes_any_text(client):  # noqa: F811
    """A text format holds the input to nothing: the random model writes on until the limit cuts the call,
    whose input is the text it wrote."""
    tool = {"type": "custom", "name": "note", "description": "Takes a note"}
    request = {"model": "x", "input": "Note this.", "max_output_tokens": 40, "temperature": 0}
    response = client.responses.create(
        **request, tools=[tool], tool_choice={"type": "custom", "name": "note"}
    )
    (call,) = response.output
    assert (call.type, call.name, call.status, response.status) == (
        "custom_tool_call",
        "note",
        "incomplete",
        "incomplete",
    )
    assert call.input != "" and not call.input.startswith("{")


@pytest.mark.parametrize("parallel", [True, False])
def test_a_call_the_model_opens_to_a_custom_tool_follows_its_grammar(served, parallel):  # noqa: F811
    """With no call forced (Codex's `tool_choice` auto), a section the model opens is held to the tools up
    to its end, whatever the model prefers: here random logits, after the model wrote the opening of a
    call to a custom tool with a grammar, which its input follows; any further call (none where
    parallel_tool_calls is false) follows its tool's. The text before the section is free, and the
    answer ends with the section: the calls to run."""
    nothing = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [calc_tool("lark"), {"type": "function", "name": "noop", "parameters": nothing}]
    body = ResponsesRequest.model_validate(
        {"input": "Add.", "tools": tools, "temperature": 0, "parallel_tool_calls": parallel}
    )
    chat_request = body.chat_request()
    prompt = served.prepare_chat(chat_request)
    logic = served.new_sequence(chat_request, prompt.tokens, 400, chat=prompt)
    assert logic.constraint.allowed() is None  # free text
    opening = (
        "Let me add.<|tool_calls_section_begin|><|tool_call_begin|>functions.calc:0"
        "<|tool_call_argument_begin|>"
    )
    total = Piece()
    for token in served.tokenizer.encode(opening, allow_special=True, add_bos=False):
        total.extend(logic.accept(token))
    random_model = torch.Generator().manual_seed(7)
    end = served.tokenizer.token_id("<|tool_call_end|>")
    ended = None
    while not logic.sequence.done:
        logits = torch.randn(served.vocab_size, generator=random_model)
        token = logic.choose(logits)
        total.extend(logic.accept(token))
        if token == end and ended is None:
            ended = logic.constraint.allowed()
    first, *more = total.tool_calls
    assert first.name == "calc" and total.content == "Let me add."
    assert follows("lark", first.arguments), first.arguments
    for call in more:
        assert follows("lark", call.arguments) if call.name == "calc" else json.loads(call.arguments) == {}
    begin = served.tokenizer.token_id("<|tool_call_begin|>")
    assert bool(ended[begin]) == parallel  # after the call: a second one, or the section's end alone
    assert logic.finish_reason == "tool_calls"


def test_a_custom_call_and_its_output_go_back_and_reuse_the_first_turns_prompt(client):  # noqa: F811
    first = forced_calc(client, "lark")
    call = first.output[0]
    turn = [
        {"role": "user", "content": "Add two numbers."},
        call.model_dump(exclude_none=True),  # the output item as it came, as Codex sends it back
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "42"},
    ]
    request = {"model": "x", "input": turn, "max_output_tokens": 6, "temperature": 0}
    second = client.responses.create(**request, tools=[calc_tool("lark")])
    cached = second.usage.input_tokens_details.cached_tokens
    assert (
        first.usage.input_tokens <= cached < second.usage.input_tokens
    )  # the first turn came from the cache
    # the input reaches the prompt as written: a word more is a token more (texts the model did not
    # write: the model's own may be in more ids than the tokenizer's, prompt-cache.md "Match")
    edited = [copy.deepcopy(turn) for _ in range(2)]
    edited[0][1]["input"], edited[1][1]["input"] = call.input + " one", call.input + " one two"
    short, longer = (
        client.responses.create(**{**request, "input": text}, tools=[calc_tool("lark")]) for text in edited
    )
    assert longer.usage.input_tokens > short.usage.input_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "tools": [
                    {
                        **calc_tool("lark"),
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"},
                    }
                ]
            },
            "tools.0.format.definition",
        ),
        (
            {
                "tools": [
                    {
                        **calc_tool("regex"),
                        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-"},
                    }
                ]
            },
            "tools.0.format.definition",
        ),
        (
            {"tools": [{**calc_tool("lark"), "format": {"type": "grammar", "syntax": "lark"}}]},
            "tools.0.format.definition",
        ),
        (
            {
                "tools": [
                    {
                        **calc_tool("lark"),
                        "format": {"type": "grammar", "syntax": "lark", "definition": LONG_GRAMMAR},
                    }
                ]
            },
            "tools.0.format.definition",
        ),
        (
            {
                "tools": [
                    {
                        **calc_tool("lark"),
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: <|nope|>"},
                    }
                ]
            },
            "tools.0.format.definition",  # a special token the vocabulary lacks, with no call forced
        ),
        (
            {
                "tools": [
                    {
                        **calc_tool("lark"),
                        "name": f"calc{n}",
                        "format": {"type": "grammar", "syntax": "lark", "definition": HALF_GRAMMAR},
                    }
                    for n in range(2)
                ]
            },
            "tools.1.format.definition",
        ),
        ({"tools": [{"type": "custom", "description": "no name"}]}, "tools.0.name"),
        ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tools": [calc_tool("lark")], "tool_choice": {"type": "function", "name": "calc"}}, "tool_choice"),
        ({"tools": [{"type": "namespace", "name": "mcp"}]}, "tools.0.tools"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "calc"}]}, "input.0.input"),
        ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, "input.0.action"),
    ],
)
def test_bad_codex_shaped_requests_are_one_error_naming_the_field(server, fields, param):  # noqa: F811
    response = post(server, {"input": "hi", **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
