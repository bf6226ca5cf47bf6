"""Tool calls, reasoning, structured output and logprobs: the real `openai` client against `k3stream
serve` on tiny random Kimi-K3 GGUFs whose tokenizer carries Kimi-K2's tool template and `<think>` tokens.

Random weights never choose to call a tool, so calls are forced with `tool_choice` (constrained
decoding): the answer must still be a well-formed call whose arguments validate against the schema.
"""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
import torch

from chat_models import KIMI_TOOL_TEMPLATE, retokenized
from k3stream.engine.chat import ChatTemplate
from k3stream.engine.generate import Sequence
from k3stream.engine.loading import load_runtime
from k3stream.engine.sampling import SamplingParams
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.grammar import BannedTokens
from k3stream.server.live import ServerProcess, ServerThread
from k3stream.server.request_logic import RequestLogic
from k3stream.server.runtime import ChatPrompt, served_from_runtime
from k3stream.server.schemas import ChatCompletionRequest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tool_gguf(tiny_model, tmp_path_factory):
    source = tiny_model(vocab=600, context_length=2048)
    out = tmp_path_factory.mktemp("tools") / "kimi-tools.gguf"
    return retokenized(source, out, chat_template=KIMI_TOOL_TEMPLATE, special_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def builtin_gguf(tiny_model, tmp_path_factory):
    """The same model with no chat template in the file: the built-in Kimi-K3 one is used."""
    out = tmp_path_factory.mktemp("builtin") / "kimi-builtin.gguf"
    return retokenized(tiny_model(vocab=600, context_length=2048), out, chat_template=None)


@pytest.fixture(scope="module")
def serve(tool_gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with ServerProcess(tool_gguf, "--ctx", "2048", "--threads", "1", log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tool_gguf):
    served = served_from_runtime(load_runtime(tool_gguf))
    yield served
    served.close()


def written_pieces(served, logic, written: str | list[int]) -> list:
    """The pieces `logic` makes of `written` (text, or its token ids) taken as the model's tokens and then
    its end, one token at a time as the scheduler feeds them, up to where its sequence ends (`max_tokens`
    may cut it)."""
    if isinstance(written, str):
        written = served.tokenizer.encode(written, allow_special=True, add_bos=False)
    pieces = []
    for token in [*written, served.tokenizer.eos_id]:
        if piece := logic.accept(token):
            pieces.append(piece)
        if logic.sequence.done:
            break
    return pieces


def held_apart(prompt: ChatPrompt) -> ChatPrompt:
    """`prompt` with no grammar: the parser takes what the model writes alone (a section's grammar ends
    the answer at the section's end, so text after a call comes only where nothing holds the section)."""
    return replace(prompt, constraints=(None,) * len(prompt.constraints))


def chat(client, **fields):
    return client.chat.completions.create(
        model="kimi-tools", **{"messages": ASK, "max_tokens": 120, **fields}
    )


def stream_chat(client, **fields):
    return list(chat(client, stream=True, **fields))


def check_call(call, names=("get_weather",)):
    assert call.type == "function" and call.function.name in names
    assert call.id.startswith(f"functions.{call.function.name}:")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_named_tool_call(client, sampling):
    answer = chat(client, tools=TOOLS, tool_choice=NAMED, **sampling)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    assert choice.message.tool_calls[0].id == "functions.get_weather:0"  # Kimi numbers calls from 0


def test_streamed_tool_call_equals_the_whole_one(client):
    whole = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0).choices[0].message.tool_calls[0]
    chunks = stream_chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0)
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0}
    assert len([d for d in deltas if d.function.arguments]) > 1, "the arguments came whole, not as they grew"
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert [d.id for d in deltas if d.id] == [whole.id]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_picks_one_of_the_tools(client):
    answer = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], names=tuple(SCHEMAS))


def test_multi_turn_with_a_tool_result(client, served):
    first = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 21}'},
    ]
    answer = client.chat.completions.create(
        model="kimi-tools", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(
        model="kimi-tools",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    assert [c.id.rsplit(":", 1)[1] for c in again.choices[0].message.tool_calls][0] == "1"  # the second call
    rendered = ChatTemplate.for_tokenizer(served.tokenizer).render(
        [{**m, "content": m["content"] or ""} for m in messages], tools=TOOLS
    )
    assert f"## Return of {call.id}\n" in rendered and "<|tool_calls_section_begin|>" in rendered
    assert answer.usage.prompt_tokens == len(served.tokenizer.encode(rendered, allow_special=True))


def test_a_call_sent_back_re_serialised_is_written_as_the_model_wrote_it(client, serve):
    """LangChain and others parse a call's arguments and dump them again (`json.dumps`: spaces, here the
    keys reversed too): the server writes the arguments the model wrote, the same JSON value, so the next
    turn restores the cached answer past the call and computes only its new tokens (and /apply-template
    renders that prompt); arguments of another value are written as sent, and the cache match ends
    inside them."""
    question = [{"role": "user", "content": "The weather in Lima, please?"}]
    first = chat(client, messages=question, tools=TOOLS, tool_choice=NAMED, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    value = json.loads(call.function.arguments)
    dumped = json.dumps(dict(reversed(value.items())))
    assert dumped != call.function.arguments and json.loads(dumped) == value

    def history(arguments: str) -> list[dict]:
        function = {"name": call.function.name, "arguments": arguments}
        sent = {"id": call.id, "type": "function", "function": function}
        return [
            *question,
            {"role": "assistant", "content": None, "tool_calls": [sent]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]

    def next_turn(arguments: str):
        return chat(client, messages=history(arguments), tools=TOOLS, temperature=0, max_tokens=4)

    answered = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token: not fed
    redumped = next_turn(dumped)
    assert redumped.usage.prompt_tokens_details.cached_tokens == answered
    echoed = next_turn(call.function.arguments)
    assert echoed.usage.prompt_tokens == redumped.usage.prompt_tokens
    assert echoed.choices[0].message.content == redumped.choices[0].message.content
    rendered = [
        httpx.post(
            serve.url + "/apply-template", json={"messages": history(arguments), "tools": TOOLS}, timeout=60
        ).json()["prompt"]
        for arguments in (dumped, call.function.arguments)
    ]
    assert rendered[0] == rendered[1] and call.function.arguments in rendered[0]
    other = {**value, "days": value["days"] % 9 + 1}
    changed = next_turn(json.dumps(other, separators=(",", ":")))
    assert changed.usage.prompt_tokens_details.cached_tokens < answered


# a user question, the assistant's call of get_time and the tool's result
TIME_CALL = {
    "id": "functions.get_time:0",
    "type": "function",
    "function": {"name": "get_time", "arguments": "{}"},
}
TIME_TURN = [
    {"role": "user", "content": "time?"},
    {"role": "assistant", "content": "", "tool_calls": [TIME_CALL]},
    {"role": "tool", "tool_call_id": TIME_CALL["id"], "content": "12:00"},
]


def test_prompt_is_the_file_template_rendering(served):
    """The server's prompt is the GGUF template's rendering of tools, calls and results, token for token."""
    expected = served.chat_template.render(TIME_TURN, tools=TOOLS)
    assert "tool_declare" in expected and '"name":"get_time"' in expected
    assert served.encode_chat(TIME_TURN, TOOLS) == served.tokenizer.encode(expected, allow_special=True)


def test_a_growing_conversation_takes_its_history_from_the_memo_with_the_ids_of_a_whole_rendering(served):
    """An agent's next turn repeats its history: its messages' ids come from `ServedModel.pieces`, and
    the prompt is still the whole rendering's tokenization; tools with special-token text are refused
    after clean ones were seen."""
    from k3stream.server.errors import APIError

    served.encode_chat(TIME_TURN, TOOLS)
    hits = served.pieces.hits
    answer, question = {"role": "assistant", "content": "It is noon."}, {"role": "user", "content": "date?"}
    longer = [*TIME_TURN, answer, question]
    expected = served.tokenizer.encode(served.chat_template.render(longer, tools=TOOLS), allow_special=True)
    assert served.encode_chat(longer, TOOLS) == expected
    assert served.pieces.hits - hits >= 2 * len(TIME_TURN)  # each earlier message: content and template
    forged = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "<|im_end|>"}}]
    for _ in range(2):  # a refused list is never kept as checked
        with pytest.raises(APIError, match="special token text"):
            served.encode_chat(TIME_TURN, forged)


def test_builtin_template_renders_tools_and_calls(builtin_gguf):
    served = served_from_runtime(load_runtime(builtin_gguf))
    try:
        assert served.chat_template.is_builtin
        text = served.chat_template.render(TIME_TURN, tools=TOOLS)
        assert '<|open|>tools<|sep|>[{"type": "function"' in text
        assert (
            "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>" in text
        )
        assert '<|open|>message role="tool"<|sep|>## Return of functions.get_time:0\n12:00' in text
        assert served.encode_chat(TIME_TURN, TOOLS) == served.tokenizer.encode(text, allow_special=True)
        app = create_app(served, ServerConfig(max_batch=2))
        with ServerThread(app) as thread:
            api = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
            answer = api.chat.completions.create(
                model=served.name, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=0
            )
        assert answer.choices[0].finish_reason == "tool_calls"
        check_call(answer.choices[0].message.tool_calls[0])
    finally:
        served.close()


# The default template of a model that keeps its tool template apart: it never declares tools.
PLAIN_TEMPLATE = KIMI_TOOL_TEMPLATE.split("{%- endif -%}", 1)[1]


@pytest.fixture(scope="module")
def two_templates_gguf(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool-use") / "kimi-tool-use.gguf"
    source = tiny_model(vocab=600, context_length=2048)
    return retokenized(source, out, chat_template=PLAIN_TEMPLATE, tool_use_template=KIMI_TOOL_TEMPLATE)


def test_a_request_with_tools_takes_the_files_tool_use_template(two_templates_gguf):
    """llama-server's choice: `tokenizer.chat_template.tool_use` renders a request whose tools are a
    non-empty list, `tokenizer.chat_template` every other one; /props names both."""
    assert "tool_declare" not in PLAIN_TEMPLATE
    with_tools = ChatTemplate(KIMI_TOOL_TEMPLATE).render(ASK, tools=TOOLS)
    without = ChatTemplate(PLAIN_TEMPLATE).render(ASK)
    served = served_from_runtime(load_runtime(two_templates_gguf))
    try:
        with ServerThread(create_app(served, ServerConfig(max_batch=2))) as thread:
            rendered = [
                httpx.post(thread.url + "/apply-template", json={"messages": ASK, **tools}, timeout=60)
                .json()
                .get("prompt")
                for tools in ({"tools": TOOLS}, {}, {"tools": []})
            ]
            props = httpx.get(thread.url + "/props", timeout=60).json()
            api = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
            answer = api.chat.completions.create(
                model=served.name, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=0
            )
        assert rendered == [with_tools, without, without]
        assert props["chat_template"] == PLAIN_TEMPLATE
        assert props["chat_template_tool_use"] == KIMI_TOOL_TEMPLATE
        assert answer.usage.prompt_tokens == len(served.tokenizer.encode(with_tools, allow_special=True))
        check_call(answer.choices[0].message.tool_calls[0])
    finally:
        served.close()


def test_a_file_whose_only_template_is_tool_use_renders_every_request_with_it(tiny_model, tmp_path):
    """As llama.cpp: with no `tokenizer.chat_template`, the `tool_use` one is the default too."""
    from k3stream.engine.tokenizer import Tokenizer

    source = tiny_model(vocab=600, context_length=2048)
    out = tmp_path / "only-tool-use.gguf"
    path = retokenized(source, out, chat_template=None, tool_use_template=PLAIN_TEMPLATE)
    template = ChatTemplate.for_tokenizer(Tokenizer.from_gguf(path))
    assert not template.is_builtin
    assert template.render(ASK) == ChatTemplate(PLAIN_TEMPLATE).render(ASK)
    assert template.render(ASK, tools=TOOLS) == ChatTemplate(PLAIN_TEMPLATE).render(ASK, tools=TOOLS)


def test_builtin_templates_think_channel_is_reasoning_and_a_forced_call_follows_it(builtin_gguf):
    """The built-in template opens `<|open|>think<|sep|>`: the answer is reasoning until the channel
    closes (`<|close|>think<|sep|><|open|>response<|sep|>`), and a forced call's grammar applies from
    there; the template writes an earlier turn's reasoning in that channel."""
    served = served_from_runtime(load_runtime(builtin_gguf))
    thinking = {"chat_template_kwargs": {"thinking": True}}
    try:
        turn = {"role": "assistant", "content": "Noon.", "reasoning_content": "Look it up."}
        rendered = served.chat_template.render([*ASK, turn], add_generation_prompt=False)
        close = "<|close|>think<|sep|><|open|>response<|sep|>"
        assert f"<|open|>think<|sep|>Look it up.{close}Noon." in rendered
        body = ChatCompletionRequest(
            model=served.name, messages=ASK, tools=TOOLS, tool_choice=NAMED, **thinking
        )
        prompt = served.prepare_chat(body)
        assert prompt.in_reasoning
        constraint = prompt.constraints[0]
        for token in served.tokenizer.encode("Plan." + close, allow_special=True):
            assert constraint.allowed()[token]
            constraint.advance(token)
        section = served.tokenizer.token_id("<|tool_calls_section_begin|>")
        assert constraint.allowed().nonzero().flatten().tolist() == [section]
        with ServerThread(create_app(served, ServerConfig(max_batch=2))) as thread:
            api = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
            answer = api.chat.completions.create(
                model=served.name, messages=ASK, max_tokens=12, temperature=0, extra_body=thinking
            )
        message = answer.choices[0].message
        assert message.model_extra["reasoning_content"] and not message.content
    finally:
        served.close()


def test_a_call_cut_off_before_its_arguments_is_the_call_without_them(client):
    """Each `max_tokens` that cuts a forced call before its arguments: no text (the section's markup is
    no content) and, once its header names the tool whole, the call with empty arguments, `finish_reason`
    `length`, streamed and whole alike."""
    call = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0).choices[0].message.tool_calls[0]
    named = []
    for max_tokens in range(1, 40):
        sampling = {"tools": TOOLS, "tool_choice": NAMED, "temperature": 0, "max_tokens": max_tokens}
        choice = chat(client, **sampling).choices[0]
        calls = choice.message.tool_calls or []
        if any(cut.function.arguments for cut in calls):
            break
        assert choice.finish_reason == "length" and not choice.message.content
        chunks = [c.choices[0] for c in stream_chat(client, **sampling) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == ""
        deltas = [
            (d.id, d.function.name, d.function.arguments) for c in chunks for d in c.delta.tool_calls or []
        ]
        assert (
            deltas == [(cut.id, cut.function.name, "") for cut in calls]
            and chunks[-1].finish_reason == "length"
        )
        assert [(cut.id, cut.function.name) for cut in calls] in ([], [(call.id, call.function.name)])
        named += calls
    assert named, "no max_tokens cut the call between its name and its arguments"


def test_call_cut_off_inside_its_arguments_keeps_them_with_finish_reason_length(client):
    """As OpenAI and llama-server answer a call that max_tokens cuts: `finish_reason` `length` (not
    `tool_calls`: the call is unfinished and must not be run) and the arguments that came, a prefix of the
    whole call's; streamed deltas add up to the same."""
    whole = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0)
    call = whole.choices[0].message.tool_calls[0]
    cut_inside = 0
    for max_tokens in range(7, whole.usage.completion_tokens):
        choice = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=max_tokens).choices[0]
        assert choice.finish_reason == "length"
        if not choice.message.tool_calls:
            continue  # cut before the call's header named its tool whole
        (cut,) = choice.message.tool_calls
        assert (cut.id, cut.function.name, choice.message.content) == (call.id, call.function.name, None)
        assert call.function.arguments.startswith(cut.function.arguments)
        cut_inside += bool(cut.function.arguments) and cut.function.arguments != call.function.arguments
        if cut_inside == 1 and cut.function.arguments != call.function.arguments:
            chunks = stream_chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=max_tokens)
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert "".join(d.function.arguments or "" for d in deltas) == cut.function.arguments
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert cut_inside > 1, "no max_tokens cut the call inside its arguments"


def test_tool_choice_none_never_opens_a_section(served):
    """The section token is the most likely one, yet never chosen."""
    tokenizer = served.tokenizer
    section = tokenizer.token_id("<|tool_calls_section_begin|>")
    sequence = Sequence(tokenizer, [1], SamplingParams(temperature=0, max_tokens=4))
    logic = RequestLogic(sequence, tokenizer, constraint=BannedTokens([section], tokenizer.vocab_size))
    logits = torch.zeros(tokenizer.vocab_size)
    logits[section] = 50.0
    assert logic.choose(logits) != section
    unconstrained = RequestLogic(
        Sequence(tokenizer, [1], SamplingParams(temperature=0, max_tokens=4)), tokenizer
    )
    assert unconstrained.choose(logits) == section


def test_json_schema_output_validates(client):
    schema = {"name": "forecast", "schema": WEATHER, "strict": True}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        choice = chat(
            client, response_format={"type": "json_schema", "json_schema": schema}, **sampling
        ).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_object_output_is_an_object(client):
    choice = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=200).choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {
            "properties": {"city": {"enum": ["Paris", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    ],
    ids=["empty", "untyped"],
)
def test_a_forced_call_of_a_schema_without_a_type_is_a_call_with_an_object(client, parameters):
    """A schema naming no type admits any JSON value, but a call's arguments are a JSON object (the
    only arguments a call can be parsed from): a forced call is always a call, never raw section text."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
    for seed in range(4):
        sampling = {"temperature": 1.0, "seed": seed, "parallel_tool_calls": False, "max_tokens": 200}
        choice = chat(client, tools=[tool], tool_choice="required", **sampling).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments, dict)
            jsonschema.validate(arguments, parameters)


def test_a_forced_call_of_a_schema_of_another_type_than_object_is_a_400(serve):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "string"}}}
    body = {"messages": ASK, "max_tokens": 4, "tools": [tool], "tool_choice": "required"}
    response = httpx.post(serve.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools.0.function.parameters"


def test_json_object_with_llama_servers_schema_follows_the_schema(client, serve):
    """llama-server's `{"type": "json_object", "schema": ...}`: the answer follows the schema, as there;
    a schema that is not one is a 400 naming it."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        format_ = {"type": "json_object", "schema": WEATHER}
        choice = chat(client, response_format=format_, **sampling).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    format_ = {"type": "json_object", "schema": {"type": "no-such-type"}}
    body = {"messages": ASK, "max_tokens": 4, "response_format": format_}
    response = httpx.post(serve.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.schema"


# a string pattern llguidance cannot compile (a lookbehind)
LOOKBEHIND = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
    "required": ["a"],
}
# schemas llguidance compiles but cannot follow: a recursion without end, and one its parser gives up on
UNFOLLOWABLE = {
    "endless": {"$ref": "#"},
    "too complex": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
}


@pytest.mark.parametrize("schema", UNFOLLOWABLE.values(), ids=list(UNFOLLOWABLE))
def test_a_schema_the_grammar_cannot_follow_is_a_one_line_400_and_health_stays_ok(serve, schema):
    """Never an empty answer passed off as a complete one, never a 500 carrying the parser's state dump,
    and a client's schemas cannot turn /health unhealthy."""
    from k3stream.server.app import UNHEALTHY_AFTER

    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": ASK, "max_tokens": 20, "response_format": format_}
    for _ in range(UNHEALTHY_AFTER):
        response = httpx.post(serve.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and "\n" not in error["message"]
    streamed = httpx.post(serve.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "response_format" and "\n" not in events[-1]["error"]["message"]
    assert httpx.get(serve.url + "/health", timeout=60).json()["status"] == "ok"


def test_reasoning_goes_to_reasoning_content(client):
    """The template opens `<think>`: the answer is reasoning until `</think>`; with the split off, the
    same greedy text is content."""
    thinking = {"chat_template_kwargs": {"thinking": True}}
    split = chat(client, temperature=0, max_tokens=16, extra_body=thinking).choices[0].message
    whole = chat(client, temperature=0, max_tokens=16, extra_body={**thinking, "separate_reasoning": False})
    reasoning = split.model_extra["reasoning_content"]
    assert reasoning and (split.content or "") == ""
    assert whole.choices[0].message.content.startswith(reasoning)
    raw = chat(client, temperature=0, max_tokens=16, extra_body={**thinking, "reasoning_format": "none"})
    assert raw.choices[0].message == whole.choices[0].message  # llama-server's switch does the same
    chunks = stream_chat(client, temperature=0, max_tokens=16, extra_body=thinking)
    streamed = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert streamed == reasoning
    plain = chat(client, temperature=0, max_tokens=16)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    usage = chat(client, temperature=0, max_tokens=16, extra_body=thinking).usage  # thinking to the end
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 16
    usage = stream_chat(
        client, temperature=0, max_tokens=16, stream_options={"include_usage": True}, extra_body=thinking
    )[-1].usage
    assert usage.completion_tokens_details.reasoning_tokens == 16


def test_llama_servers_enable_thinking_and_reasoning_budget_zero_set_kimis_thinking(client, served):
    """llama-server's clients turn thinking on and off with `chat_template_kwargs.enable_thinking`, and
    its `--reasoning-budget 0` turns it off for every request: Kimi's templates read `thinking`, which
    they set where `thinking` itself is not named."""
    from k3stream.cli import build_parser
    from k3stream.commands.serve import template_defaults

    def prompt(kwargs):
        body = ChatCompletionRequest.model_validate({"messages": ASK, "chat_template_kwargs": kwargs})
        return served.prepare_chat(body)

    assert prompt({"enable_thinking": True}).tokens == prompt({"thinking": True}).tokens
    assert (
        prompt({"enable_thinking": True}).in_reasoning and not prompt({"enable_thinking": False}).in_reasoning
    )
    assert prompt({"enable_thinking": True, "thinking": False}).tokens == prompt({}).tokens
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    by_llama = chat(client, temperature=0, max_tokens=8, extra_body=on).choices[0].message
    by_kimi = chat(
        client, temperature=0, max_tokens=8, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    assert (
        by_llama.model_extra["reasoning_content"]
        == by_kimi.choices[0].message.model_extra["reasoning_content"]
    )
    parser = build_parser(["serve"])
    budget = parser.parse_args(
        ["serve", "m.gguf", "--reasoning-budget", "0", "--chat-template-kwargs", '{"x": 1}']
    )
    kept = served.template_kwargs
    served.template_kwargs = template_defaults(budget)
    try:
        assert prompt({"thinking": True}).in_reasoning and not prompt(None).in_reasoning
        served.template_kwargs = {"thinking": True}
        assert prompt(None).in_reasoning and not prompt({"enable_thinking": False}).in_reasoning
    finally:
        served.template_kwargs = kept
    with pytest.raises(ValueError, match=r"^--reasoning-budget must be -1 \(unrestricted\) or 0"):
        template_defaults(parser.parse_args(["serve", "m.gguf", "--reasoning-budget", "512"]))


def test_reasoning_effort_turns_thinking_on_or_off(client):
    """OpenAI's and llama-server's `reasoning_effort` on a chat request: `none` turns Kimi's thinking off,
    any other effort on (no levels); `chat_template_kwargs` win."""
    on = {"chat_template_kwargs": {"thinking": True}}
    by_kwargs = chat(client, temperature=0, max_tokens=8, extra_body=on).choices[0].message
    by_effort = chat(client, temperature=0, max_tokens=8, reasoning_effort="high").choices[0].message
    assert by_effort.model_extra["reasoning_content"] == by_kwargs.model_extra["reasoning_content"] != ""
    plain = chat(client, temperature=0, max_tokens=8)
    off = chat(client, temperature=0, max_tokens=8, reasoning_effort="none")
    assert (
        off.usage.prompt_tokens == plain.usage.prompt_tokens
        and off.choices[0].message == plain.choices[0].message
    )
    kept_off = chat(
        client,
        temperature=0,
        max_tokens=8,
        reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    assert kept_off.usage.prompt_tokens == plain.usage.prompt_tokens


def test_input_tokens_counts_the_prompt_a_chat_request_would_prefill(client, serve):
    """llama-server's `POST /v1/chat/completions/input_tokens`: OpenAI's `response.input_tokens` object
    of the prompt the same chat body would prefill, tools and template variables included; a bad body is
    the chat request's 400."""
    body = {"messages": ASK, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}}
    answered = chat(
        client, max_tokens=1, tools=TOOLS, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    counted = httpx.post(serve.url + "/v1/chat/completions/input_tokens", json=body, timeout=60)
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": answered.usage.prompt_tokens}
    bad = httpx.post(
        serve.url + "/v1/chat/completions/input_tokens", json={**body, "tool_choice": "x"}, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    (card,) = client.models.list().data
    assert card.model_extra["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}


def test_reasoning_content_of_an_earlier_turn_reaches_the_template(client, serve):
    """An agent sends its tool-calling turns back with their `reasoning_content` (Moonshot's API requires
    it of a thinking model's tool loop); Kimi-K2-Thinking's template writes it into the turn, so the
    prompt holds the tokens the model generated, as vLLM's and llama-server's prompts do."""
    arguments = json.dumps({"zone": "UTC"})
    call = {
        "id": "functions.get_time:0",
        "type": "function",
        "function": {"name": "get_time", "arguments": arguments},
    }
    thought = "The user asks for the time first."

    def loop(**reasoning):
        answer = {"role": "assistant", "content": "", "tool_calls": [call], **reasoning}
        return [*ASK, answer, {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]

    rendered = httpx.post(serve.url + "/apply-template", json={"messages": loop(reasoning_content=thought)})
    assert f"<think>{thought}</think><|tool_calls_section_begin|>" in rendered.json()["prompt"]
    without = chat(client, messages=loop(), tools=TOOLS, max_tokens=1).usage.prompt_tokens
    kept = chat(
        client, messages=loop(reasoning_content=thought), tools=TOOLS, max_tokens=1
    ).usage.prompt_tokens
    thought_tokens = httpx.post(serve.url + "/tokenize", json={"content": thought}).json()["tokens"]
    assert kept == without + 2 + len(thought_tokens)  # <think>, </think> and the thought


@pytest.mark.parametrize("forced", ["tool_choice", "response_format"])
def test_forced_output_follows_the_think_block_the_prompt_opened(client, served, forced):
    """A thinking prompt ends inside `<think>`: the grammar of a forced call or format applies once the
    block closes (as vLLM's structured output with a reasoning parser), so the call comes back as a
    tool call and the JSON as content, not both as reasoning. Biases make the model close the block at
    once, and would end the answer there were the end of the turn not refused inside the block."""
    close, end = (served.tokenizer.token_id(token) for token in ("</think>", "<|im_end|>"))
    fields = {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(close): 50, str(end): 100}}
    if forced == "tool_choice":
        answer = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, extra_body=fields).choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
        check_call(answer.message.tool_calls[0])
    else:
        format_ = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
        answer = chat(client, response_format=format_, temperature=0, extra_body=fields).choices[0]
        assert answer.finish_reason == "stop"
        jsonschema.validate(json.loads(answer.message.content), WEATHER)
    assert not answer.message.model_extra.get("reasoning_content")


@pytest.mark.parametrize("field", ["arguments", "reasoning_content"])
def test_a_turn_spelling_a_special_token_in_its_call_or_reasoning_is_plain_text(client, served, field):
    """A coding agent's call may write text holding `<|im_end|>` (a file about chat templates), and its
    reasoning may mention it: sent back, that text is tokenized as plain text, as message content is,
    instead of refusing the conversation (a 400 every later turn repeats) or forging a token."""
    spelled = "a template line ending in <|im_end|>"
    arguments = json.dumps({"zone": "UTC", **({"note": spelled} if field == "arguments" else {})})
    call = {
        "id": "functions.get_time:0",
        "type": "function",
        "function": {"name": "get_time", "arguments": arguments},
    }
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    if field == "reasoning_content":
        answer["reasoning_content"] = spelled
    messages = [*ASK, answer, {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    usage = chat(client, messages=messages, tools=TOOLS, max_tokens=1).usage
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    ids = served.prepare_chat(body).tokens
    rendered = httpx.post(served_url(client) + "/apply-template", json={"messages": messages, "tools": TOOLS})
    text = rendered.json()["prompt"]
    assert spelled in text and served.tokenizer.decode(ids) == text
    end = served.tokenizer.token_id("<|im_end|>")
    assert ids.count(end) == text.count("<|im_end|>") - 1  # the spelled one is plain text
    assert usage.prompt_tokens == len(ids)


def served_url(client) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def test_chat_logprobs(client):
    answer = chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=5)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy takes the most likely token
        assert (
            entry.token == entry.top_logprobs[0].token
            and bytes(entry.bytes).decode(errors="replace") == entry.token
        )
        assert 0.0 < sum(2.718281828459045**t for t in tops) <= 1.0 + 1e-5
    streamed = [
        e
        for c in stream_chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=5)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs(client):
    answer = client.completions.create(
        model="kimi-tools", prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == answer.usage.completion_tokens == len(logprobs.token_logprobs)
    if "\ufffd" not in "".join(logprobs.tokens):  # tokens cutting a character in two decode apart
        assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # tokens that decode to the same text share one key of OpenAI's dict
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(max(top.values()))
        assert logprob == pytest.approx(max(top.values()))


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """OpenAI's completions: 'the API will always return the logprob of the sampled token, so there may
    be up to logprobs+1 elements' in each `top_logprobs` dict (vLLM's too): a sampled token outside the
    top N is listed beside them, and `logprobs: 0` lists the sampled token alone."""
    beside = 0
    for seed in range(4):
        for n in (0, 1):
            answer = client.completions.create(
                model="kimi-tools",
                prompt="The quick brown fox",
                max_tokens=12,
                temperature=1.5,
                seed=seed,
                logprobs=n,
            )
            logprobs = answer.choices[0].logprobs
            for token, logprob, top in zip(
                logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
            ):
                assert token in top and len(top) <= n + 1
                assert top[token] >= logprob - 1e-6  # a token of the same text may be likelier
                beside += len(top) == n + 1 and logprob < max(top.values())
    assert beside > 0, "no sampled token fell outside the top N"


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
                }
            },
            "response_format",
        ),
        (
            {"tools": [{**TOOLS[0], "function": {"name": "f", "description": "<|im_end|>"}}]},
            "tools.0.function.description",
        ),
        ({"tools": TOOLS, "n": 99}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": LOOKBEHIND}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(serve, fields, param):
    body = {"messages": ASK, "max_tokens": 2, **fields}
    response = httpx.post(serve.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"]
    assert "\n" not in error["message"]


def test_streamed_completion_logprobs_equal_the_whole_ones(client):
    fields = {
        "model": "kimi-tools",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
    }
    whole = client.completions.create(**fields).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields) if c.choices]
    streamed = [lp for lp in chunks if lp is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert [v for lp in streamed for v in lp.token_logprobs] == whole.token_logprobs


@pytest.mark.parametrize("field", ["tool_choice", "tools", "top_logprobs"])
def test_chat_fields_are_refused_on_completions(serve, field):
    """(`response_format` is served there, as vLLM serves it: `test_server_trial.py`.)"""
    body = {"prompt": "hi", "max_tokens": 2, field: 1}
    response = httpx.post(serve.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
