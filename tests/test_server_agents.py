"""Agent frameworks nobody here wrote, driving a multi-turn tool loop against `k3stream serve` on
127.0.0.1 with the shipped demo model: the `openai-agents` SDK and `langchain-openai` (test extras;
skipped with the reason where missing).

The demo model's text is noise, so its first turn is a forced call (`tool_choice="required"`); the
frameworks then run the tool, send its result back and let the model answer freely, as they do with any
OpenAI-compatible server. Both send `parallel_tool_calls: false`. The server keeps a prompt cache, as
`serve` does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

import k3stream
from k3stream.engine.loading import load_runtime
from k3stream.engine.prompt_cache import PromptCache
from k3stream.memlimit import MIB
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime

DEMO_GGUF = Path(k3stream.__file__).resolve().parent / "data" / "k3-stdlib-audited.gguf"
KEY = "sk-test-agents"
FORECASTS = {"Paris": "sunny, 21 C", "Lima": "cloudy, 17 C"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    served = served_from_runtime(load_runtime(DEMO_GGUF))
    served.prompt_cache = PromptCache(served.model, "demo-agents", 64 * MIB, every=64)
    thread = ServerThread(create_app(served, ServerConfig(guard=GuardConfig(api_key=KEY)))).start()
    yield thread, served.name
    thread.stop()
    served.prompt_cache.close()
    served.close()


class City(BaseModel):
    city: Literal["Paris", "Lima"]


@pytest.mark.parametrize(
    ("model_class", "output_type", "streamed"),
    [
        ("OpenAIChatCompletionsModel", str, False),
        ("OpenAIResponsesModel", City, False),
        ("OpenAIResponsesModel", City, True),
    ],
)
def test_openai_agents_sdk_runs_a_tool_loop(server, model_class, output_type, streamed):
    """The SDK's chat model on /v1/chat/completions, its Responses model on /v1/responses (whose events
    the SDK reads when `streamed`). The Responses model takes an incomplete response for a failure, and
    the demo model's free text runs to max_tokens: there the answer is a structured output
    (`text.format`), which its grammar ends."""
    agents = pytest.importorskip(
        "agents", reason="openai-agents is not installed (pip install openai-agents)"
    )
    from openai import AsyncOpenAI

    thread, name = server
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather forecast of a city."""
        calls.append(city)
        return FORECASTS[city]

    client = AsyncOpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = agents.Agent(
        name="forecaster",
        instructions="Answer with the forecast.",
        tools=[get_weather],
        output_type=output_type,
        model=getattr(agents, model_class)(model=name, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48
        ),
    )

    async def run(question):
        if not streamed:
            return await agents.Runner.run(agent, question, max_turns=4)
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _event in result.stream_events():
            pass
        return result

    async def two_turns():
        first = await run("What is the weather in Paris?")
        return first, await run([*first.to_input_list(), {"role": "user", "content": "And in Lima?"}])

    first, second = asyncio.run(two_turns())
    assert len(calls) == 2 and set(calls) <= set(FORECASTS)
    for result in (first, second):
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
        assert isinstance(result.final_output, output_type)
    outputs = [item for item in second.to_input_list() if item.get("type") == "function_call_output"]
    assert [item["output"] for item in outputs] == [FORECASTS[city] for city in calls]


def test_langchain_openai_runs_a_tool_loop(server):
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (pip install langchain-openai)"
    )
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    thread, name = server

    @tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather forecast of a city."""
        return FORECASTS[city]

    model = ChatOpenAI(
        model=name, base_url=thread.url + "/v1", api_key=KEY, temperature=0, max_tokens=48, max_retries=0
    )
    # strict: additionalProperties false, so the grammar of a forced call admits no made-up keys
    forced = model.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False, strict=True)
    free = model.bind_tools([get_weather], parallel_tool_calls=False, strict=True)
    messages: list = []
    for question in ("What is the weather in Paris?", "And in Lima?"):
        messages.append(HumanMessage(question))
        call_message = forced.invoke(messages)
        assert len(call_message.tool_calls) == 1
        call = call_message.tool_calls[0]
        assert call["name"] == "get_weather" and call["args"]["city"] in FORECASTS
        messages += [call_message, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        answer = free.invoke(messages)
        assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in (
            "stop",
            "length",
        )
        # LangChain sends the call back with its arguments dumped again (`json.dumps(args)`): the turn
        # restores the call's answer whole, all but its last token (never fed to the model)
        asked = call_message.usage_metadata
        assert answer.usage_metadata["input_token_details"]["cache_read"] == (
            asked["input_tokens"] + asked["output_tokens"] - 1
        )
        messages.append(answer)
    assert [m.content for m in messages if isinstance(m, ToolMessage)] == [
        FORECASTS[m.tool_calls[0]["args"]["city"]] for m in messages if getattr(m, "tool_calls", None)
    ]


def test_the_demo_template_shows_the_model_its_tools_calls_and_results(server):
    """The demo's own template (Kimi-K2's) declares the tools, writes a call back as the tool-call
    section the parser read it from, token for token, and a result as a `tool` turn; plain chat renders
    as it did for the shipped model (a default system message, one turn a message)."""
    import httpx

    thread, name = server
    headers = {"Authorization": f"Bearer {KEY}"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    fields = {"model": name, "messages": ask, "tools": tools, "tool_choice": "required", "max_tokens": 48}
    answer = httpx.post(
        thread.url + "/v1/chat/completions", json={**fields, "temperature": 0}, headers=headers
    )
    call = answer.json()["choices"][0]["message"]["tool_calls"][0]
    result = {"role": "tool", "tool_call_id": call["id"], "content": FORECASTS["Paris"]}
    loop = [*ask, {"role": "assistant", "content": "", "tool_calls": [call]}, result]
    prompt = httpx.post(
        thread.url + "/apply-template", json={"messages": loop, "tools": tools}, headers=headers
    ).json()["prompt"]
    system = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    written = (
        f"<|tool_calls_section_begin|><|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>"
        f"{call['function']['arguments']}<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert prompt == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        f'"parameters":{{"type":"object"}}}}}}]<|im_end|>{system}<|im_user|>user<|im_middle|>{ask[0]["content"]}'
        f"<|im_end|><|im_assistant|>assistant<|im_middle|>{written}<|im_end|><|im_system|>tool<|im_middle|>"
        f"## Return of {call['id']}\n{FORECASTS['Paris']}<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    plain = httpx.post(thread.url + "/apply-template", json={"messages": ask}, headers=headers).json()
    assert plain["prompt"] == f"{system}<|im_user|>user<|im_middle|>{ask[0]['content']}<|im_end|>" + (
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_a_turn_restores_an_answer_the_model_wrote_in_tokens_of_its_own(server):
    """A call whose name the grammar let the model spell in pieces (`_` `t` `ime` where the tokenizer
    has `_time`), or a sampled answer, is ids the tokenizer does not give its text. Sent back in the next
    turn's history, it is written in the ids the model wrote: the turn restores the answer's state and
    computes only its new tokens, and answers what its prompt computed whole answers. The same text in
    another conversation is tokenized as the tokenizer does."""
    import httpx
    import openai

    thread, name = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [
        {"type": "function", "function": {"name": name_, "parameters": {"type": "object", "properties": {}}}}
        for name_ in ("get_weather", "get_time")
    ]

    def pieces(messages: list[dict]) -> list[str]:
        """The pieces of the prompt `messages` render to, tokenized as text (/apply-template, /tokenize)."""
        headers = {"Authorization": f"Bearer {KEY}"}
        text = httpx.post(
            thread.url + "/apply-template", json={"messages": messages, "tools": tools}, headers=headers
        ).json()["prompt"]
        tokens = httpx.post(
            thread.url + "/tokenize", json={"content": text, "with_pieces": True}, headers=headers
        )
        return [token["piece"] for token in tokens.json()["tokens"]]

    of_their_own = 0
    for seed in range(4):
        question = [{"role": "user", "content": f"Question {seed}: the weather or the time?"}]
        forced = {"tool_choice": "required", "parallel_tool_calls": False} if seed < 2 else {}
        asked = {"model": name, "tools": tools, "logprobs": True, **forced}
        first = client.chat.completions.create(
            messages=question, max_tokens=24, temperature=seed, seed=seed, **asked
        )
        answer = first.choices[0].message
        history = [*question, answer.model_dump(exclude_none=True)]
        history += [
            {"role": "tool", "tool_call_id": c.id, "content": "12:00"} for c in answer.tool_calls or []
        ]
        history += [] if answer.tool_calls else [{"role": "user", "content": "And then?"}]
        answered = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token: not fed
        written = pieces(question) + [entry.token for entry in first.choices[0].logprobs.content]
        of_their_own += pieces(history)[:answered] != written[:answered]
        turn = client.chat.completions.create(messages=history, max_tokens=4, temperature=0, **asked)
        assert turn.usage.prompt_tokens_details.cached_tokens == answered, (seed, written)
        whole = client.chat.completions.create(
            messages=history, max_tokens=4, temperature=0, extra_body={"cache_prompt": False}, **asked
        )
        assert whole.usage.prompt_tokens_details.cached_tokens == 0
        assert turn.choices[0].logprobs == whole.choices[0].logprobs
        elsewhere = [{"role": "user", "content": "Another conversation"}, *history[1:]]
        other = client.chat.completions.create(messages=elsewhere, max_tokens=1, temperature=0, **asked)
        assert other.usage.prompt_tokens == len(pieces(elsewhere))  # the tokenizer's ids: not its answer
    assert of_their_own, "no answer was written in tokens of its own: the test shows nothing"
