"""Request fields real clients send: `n` choices, frequency and presence penalties, `logit_bias` and
`parallel_tool_calls: false`, driven by the real `openai` client against a live server on 127.0.0.1 on a
tiny Kimi-K3 GGUF with Kimi-K2's tool template. Oracles: the engine's own generation loop on a second
copy of the model, and single-choice requests of the same server.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from chat_models import KIMI_TOOL_TEMPLATE, retokenized
from k3stream.engine.generate import generate
from k3stream.engine.loading import load_runtime
from k3stream.engine.sampling import SamplingParams
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.live import ServerThread
from k3stream.server.runtime import ServedModel, served_from_runtime
from k3stream.server.schemas import ChatCompletionRequest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPT = "Once upon a time"
MAX_BATCH = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tool_gguf(tiny_model, tmp_path_factory):
    source = tiny_model(vocab=600, context_length=2048)
    out = tmp_path_factory.mktemp("fields") / "kimi-fields.gguf"
    return retokenized(source, out, chat_template=KIMI_TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def server(tool_gguf):
    served = served_from_runtime(load_runtime(tool_gguf), ctx=512)
    thread = ServerThread(create_app(served, ServerConfig(max_batch=MAX_BATCH))).start()
    yield thread
    thread.stop()
    served.close()


@pytest.fixture(scope="module")
def engine(tool_gguf):
    """A second copy of the model for the engine's own generation loop."""
    served = served_from_runtime(load_runtime(tool_gguf), ctx=512)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(client, **fields):
    return client.completions.create(model="kimi-fields", prompt=PROMPT, **{"max_tokens": 8, **fields})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_seeded_choices_equal_single_requests_with_the_next_seeds(client, endpoint):
    """Choice i of a seeded n-choice request is the answer of a one-choice request with seed + i: the
    shared prefill leaves each choice what its own prefill would have."""
    if endpoint == "chat":

        def texts(**fields):
            answer = client.chat.completions.create(model="kimi-fields", messages=ASK, max_tokens=8, **fields)
            return [c.message.content for c in answer.choices], answer
    else:

        def texts(**fields):
            answer = complete(client, **fields)
            return [c.text for c in answer.choices], answer

    many, answer = texts(n=3, temperature=1.0, seed=7)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert many == [texts(temperature=1.0, seed=7 + i)[0][0] for i in range(3)]
    assert len(set(many)) > 1
    single_usage = texts(temperature=1.0, seed=7)[1].usage
    assert answer.usage.prompt_tokens == single_usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(
        texts(temperature=1.0, seed=7 + i)[1].usage.completion_tokens for i in range(3)
    )


def test_streamed_choices_equal_the_whole_ones(client):
    whole = complete(client, n=2, temperature=1.0, seed=3)
    chunks = list(
        complete(client, n=2, temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True})
    )
    streamed = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_absent_and_neutral_fields_leave_answers_unchanged(client, engine):
    """Greedy and seeded answers equal the engine loop's with default sampling, and neutral values of the
    new fields change nothing."""
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1}
    ids = engine.encode_prompt(PROMPT)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        expected = generate(
            engine.model, engine.tokenizer, ids, SamplingParams(max_tokens=8, **sampling)
        ).text
        assert complete(client, **sampling).choices[0].text == expected
        assert complete(client, **sampling, **neutral).choices[0].text == expected


@pytest.mark.parametrize(
    "endpoint, nulls",
    [
        ("completions", {"n": None, "stream": None, "echo": None, "logprobs": None, "ignore_eos": None}),
        ("chat", {"n": None, "stream": None, "logprobs": None, "separate_reasoning": None}),
    ],
)
def test_null_is_the_default_of_openais_nullable_fields(client, endpoint, nulls):
    """OpenAI's API takes null for `n`, `stream`, `logprobs`, `echo` (clients serializing unset fields
    send it): the answer is the one without them, not a 400."""
    ask = complete if endpoint == "completions" else chat
    expected = ask(client, temperature=0)
    answer = ask(client, temperature=0, extra_body=nulls)
    assert _texts(answer) == _texts(expected) and len(answer.choices) == 1
    streamed = ask(client, temperature=0, stream=True, stream_options={"include_usage": None})
    assert "".join(_texts(chunk)[0] for chunk in streamed if chunk.choices) == _texts(expected)[0]


def chat(client, **fields):
    messages = [{"role": "user", "content": PROMPT}]
    return client.chat.completions.create(
        model="kimi-fields", messages=messages, **{"max_tokens": 8, **fields}
    )


def _texts(response) -> list[str]:
    """Each choice's text: a completion's, or a chat message's or delta's content."""
    return [_text(choice) for choice in response.choices]


def _text(choice) -> str:
    if hasattr(choice, "text"):
        return choice.text
    message = choice.delta if hasattr(choice, "delta") else choice.message
    return message.content or ""


def test_penalties_follow_the_engine_loop(client, engine):
    ids = engine.encode_prompt(PROMPT)
    fields = {"frequency_penalty": 1.5, "presence_penalty": -0.5}
    params = SamplingParams(temperature=0, max_tokens=16, **fields)
    expected = generate(engine.model, engine.tokenizer, ids, params)
    plain = generate(engine.model, engine.tokenizer, ids, SamplingParams(temperature=0, max_tokens=16))
    assert complete(client, temperature=0, max_tokens=16, **fields).choices[0].text == expected.text
    assert expected.token_ids != plain.token_ids, "the penalties changed nothing on this prompt"


def test_logit_bias_forces_and_forbids_tokens(client, engine):
    ids = engine.encode_prompt(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=1)
    greedy = generate(engine.model, engine.tokenizer, ids, params).token_ids[0]
    banned = complete(client, temperature=0, max_tokens=1, logprobs=0, logit_bias={str(greedy): -100})
    assert banned.choices[0].logprobs.tokens[0] != engine.tokenizer.piece(greedy).decode()
    forced_id = next(t for t in range(300, 600) if t != greedy and engine.tokenizer.piece(t).isalpha())
    bias = {str(forced_id): 100}
    forced = complete(client, temperature=1.0, seed=5, max_tokens=4, logprobs=0, logit_bias=bias)
    assert forced.choices[0].logprobs.tokens == [engine.tokenizer.piece(forced_id).decode()] * 4


def test_parallel_tool_calls_false_is_accepted_with_any_tool_choice(client):
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(
            model="kimi-fields",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=40,
            temperature=0,
        )
        assert len(answer.choices[0].message.tool_calls or []) <= 1


def test_parallel_tool_calls_false_stops_a_second_call(engine):
    """With automatic tool choice, a second call cannot begin once one ended, however likely it is."""
    tokenizer = engine.tokenizer
    begin = tokenizer.token_id("<|tool_call_begin|>")
    after_call = torch.zeros(tokenizer.vocab_size)
    after_call[begin] = 50.0
    fields = {"messages": ASK, "tools": TOOLS, "temperature": 0}
    single = _after_one_call(engine, {**fields, "parallel_tool_calls": False})
    assert single.choose(after_call) != begin
    assert _after_one_call(engine, fields).choose(after_call) == begin


def _after_one_call(engine, fields):
    """The logic of a chat request that has generated one complete tool call."""
    tokenizer = engine.tokenizer
    body = ChatCompletionRequest.model_validate(fields)
    prompt = engine.prepare_chat(body)
    logic = engine.new_sequence(body, prompt.tokens, 64, chat=prompt)
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        + json.dumps({"city": "Paris"})
        + "<|tool_call_end|>"
    )
    for token in tokenizer.encode(call, allow_special=True, add_bos=False):
        logits = torch.zeros(tokenizer.vocab_size)
        logits[token] = 50.0
        assert logic.choose(logits) == token
        assert not logic.accept(token).content
    return logic


def test_logit_bias_text_is_tokenized_once_per_request_of_many_choices(client, monkeypatch):
    """A bias text is tokenized (on the event loop) once per request: the check and the choices share it."""
    text = "a bias text of its own"
    calls = []
    encode_text = ServedModel.encode_text

    def counted(served, piece):
        calls.append(piece)
        return encode_text(served, piece)

    monkeypatch.setattr(ServedModel, "encode_text", counted)
    answer = complete(client, n=MAX_BATCH, max_tokens=1, extra_body={"logit_bias": [[text, 1]]})
    assert len(answer.choices) == MAX_BATCH
    assert calls.count(text) == 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": MAX_BATCH + 1}, "n"),
        ({"n": 17}, "n"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"logit_bias": {"600": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"3": -100.5}}, "logit_bias.3"),
    ],
)
def test_out_of_range_fields_are_one_line_400s(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and param.split(".")[0] in error["message"]
    assert "\n" not in error["message"]


def test_seed_minus_one_draws_a_fresh_seed_as_in_llama_server(client):
    """llama-server's `seed: -1` (its default, shown by /props) asks for a random draw, not seed -1."""
    fixed = {complete(client, temperature=1.0, seed=7).choices[0].text for _ in range(2)}
    assert len(fixed) == 1
    fresh = {complete(client, temperature=1.0, seed=-1).choices[0].text for _ in range(4)}
    assert len(fresh) > 1


def test_n_predict_is_llama_servers_max_tokens(client):
    for fields, produced in (({"n_predict": 5}, 5), ({"n_predict": 5, "max_tokens": 3}, 3)):
        answer = complete(
            client, extra_body={"ignore_eos": True, **fields}, max_tokens=fields.get("max_tokens")
        )
        assert answer.usage.completion_tokens == produced
    chat = client.chat.completions.create(
        model="kimi-fields", messages=ASK, extra_body={"n_predict": 3, "ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 3
    for n_predict in (-1, 600):  # up to the context; past it, cut where it ends, as llama-server cuts it
        whole = complete(client, max_tokens=None, extra_body={"n_predict": n_predict, "ignore_eos": True})
        assert whole.usage.prompt_tokens + whole.usage.completion_tokens == 512
        assert whole.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, max_tokens=None, extra_body={"n_predict": 0})
    assert caught.value.body["param"] == "n_predict"


def test_min_p_and_repetition_penalty_follow_the_engine_loop(client, engine):
    ids = engine.encode_prompt(PROMPT)
    greedy = generate(engine.model, engine.tokenizer, ids, SamplingParams(temperature=0, max_tokens=8))
    # min_p 1 keeps only the likeliest token: a seeded draw at temperature 1 is the greedy answer
    assert complete(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0}).choices[0].text == greedy.text
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8)
    expected = generate(engine.model, engine.tokenizer, ids, params)
    plain = generate(engine.model, engine.tokenizer, ids, SamplingParams(temperature=0, max_tokens=16))
    answer = complete(client, temperature=0, max_tokens=16, extra_body={"repetition_penalty": 1.8})
    assert answer.choices[0].text == expected.text
    assert expected.token_ids != plain.token_ids, "the penalty changed nothing on this prompt"


def _first_token(client, engine, **fields) -> int:
    """The id of a greedy chat answer's first token (from its logprob's bytes)."""
    answer = client.chat.completions.create(
        model="kimi-fields", messages=ASK, max_tokens=1, temperature=0, logprobs=True, **fields
    )
    by_bytes = {bytes(engine.tokenizer.piece(t)): t for t in range(engine.vocab_size)}
    return by_bytes[bytes(answer.choices[0].logprobs.content[0].bytes)]


def test_llama_server_list_logit_bias_forces_and_bans(client, engine):
    """llama-server's `[[id, value]]` form equals OpenAI's `{"id": value}`; `[[id, false]]` bans the token."""
    greedy = _first_token(client, engine)
    assert _first_token(client, engine, extra_body={"logit_bias": [[greedy, False]]}) != greedy
    forced_id = next(t for t in range(300, 600) if t != greedy and engine.tokenizer.piece(t).isalpha())
    as_list = _first_token(client, engine, extra_body={"logit_bias": [[forced_id, 100]]})
    assert as_list == _first_token(client, engine, logit_bias={str(forced_id): 100}) == forced_id
    assert _first_token(client, engine, logit_bias={str(greedy): False}) != greedy


def test_logit_bias_text_biases_each_of_its_tokens_as_in_llama_server(client, engine):
    """llama-server's text keys (`[["text", value]]`, `{"text": value}`): each token of the text's plain
    tokenization takes the value, as if listed by id."""
    greedy = _first_token(client, engine)
    text = engine.tokenizer.decode([greedy])
    ids = engine.tokenizer.encode(text, allow_special=False, add_bos=False)
    by_ids = _first_token(client, engine, extra_body={"logit_bias": [[token, False] for token in ids]})
    assert by_ids not in ids and greedy in ids
    assert _first_token(client, engine, extra_body={"logit_bias": [[text, False]]}) == by_ids
    assert _first_token(client, engine, logit_bias={text: -100}) == by_ids


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": [[5, True]]}, "logit_bias.0.1"),
        ({"logit_bias": [["x" * 4097, 1]]}, "logit_bias.0"),
        ({"logit_bias": [[600, 1]]}, "logit_bias.0"),
        ({"mirostat": 2}, "mirostat"),
        ({"repeat_penalty": 1.1}, "repeat_penalty"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"grammar": "root ::= undefined"}, "grammar"),  # taken (structured outputs), but no GBNF
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_llama_server_fields_not_served_are_refused_by_name(client, fields, param):
    """A sampler this server does not run is a 400 naming it, never silently left out of the answer."""
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and param.split(".")[0] in error["message"]


def test_neutral_llama_server_sampler_values_are_accepted(client):
    neutral = {"mirostat": 0, "typical_p": 1.0, "repeat_penalty": 1.0, "n_probs": 0, "cache_prompt": True}
    assert (
        complete(client, temperature=0, extra_body=neutral).choices[0].text
        == complete(client, temperature=0).choices[0].text
    )


def test_stop_lists_longer_than_openais_four_are_served(client):
    """llama-server and vLLM scripts send more than OpenAI's 4 stop strings: each one ends the answer."""
    eos = {"ignore_eos": True}
    text = complete(client, temperature=0, max_tokens=16, extra_body=eos).choices[0].text
    stops = [f"never{i}" for i in range(15)]
    last = text[3:6]
    cut = complete(client, temperature=0, max_tokens=16, stop=[*stops, last], extra_body=eos).choices[0]
    assert cut.text == text[: text.index(last)] and cut.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, stop=[*stops, "a", "b"])
    assert caught.value.body["param"] == "stop" and "16" in caught.value.body["message"]


def test_stop_token_ids_end_the_answer_before_the_token(client, engine):
    """vLLM's `stop_token_ids`: the answer ends where that token would come, without its text."""
    ids = engine.encode_prompt(PROMPT)
    greedy = generate(engine.model, engine.tokenizer, ids, SamplingParams(temperature=0, max_tokens=8))
    stop = greedy.token_ids[3]
    before = greedy.token_ids[: greedy.token_ids.index(stop)]
    answer = complete(client, temperature=0, extra_body={"stop_token_ids": [stop]}).choices[0]
    assert answer.text == engine.tokenizer.decode(before) and answer.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, extra_body={"stop_token_ids": [1, 600]})
    assert caught.value.body["param"] == "stop_token_ids.1"
    for field, value in (("allowed_token_ids", [1]), ("bad_words", ["a"]), ("dynatemp_range", 0.5)):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(client, extra_body={field: value})
        assert caught.value.body["param"] == field
