"""The OpenAI-compatible server, driven by the real `openai` client against a live uvicorn on 127.0.0.1.

The model is a tiny Kimi-K3 GGUF packed by the real packer; its routed experts stream from the expert
store with a RAM budget smaller than the pack. Greedy answers are checked against the engine's own
generation loop on a second copy of the model that reads experts straight from the GGUF.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from k3stream import LoadOptions
from k3stream.engine.loading import StoreOptions, load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.live import ServerProcess, ServerThread
from k3stream.server.runtime import served_from_runtime
from waiting import wait_until

MAX_BATCH = 4
MAX_QUEUE = 4
CTX = 256
SLOW_READ_US = 3000


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def served_pack(tiny_gguf, tmp_path_factory):
    from k3stream.pack.builder import BuildOptions, build_pack

    out = tmp_path_factory.mktemp("pack")
    manifest = out / "tiny.manifest.json"
    build_pack(tiny_gguf, out / "tiny.pack", manifest, BuildOptions(progress=False))
    return manifest


@pytest.fixture(scope="module")
def ram_mib(served_pack):
    """Room for two MoE layers' experts: any one step's working set fits, the whole pack does not."""
    from k3stream.pack.reader import ExpertPack

    with ExpertPack(served_pack) as pack:
        assert len(pack.moe_layers) > 2
        return 2 * pack.num_experts * pack.object_bytes / (1 << 20)


class LiveServer:
    """The app on a uvicorn thread, plus the probes the tests read."""

    def __init__(self, manifest, ram_mib, store_options=None, **config):
        options = LoadOptions(expert_ram_mib=ram_mib)
        runtime = load_runtime(manifest, options, store_options=store_options or StoreOptions())
        self.served = served_from_runtime(runtime, ctx=CTX)
        self.name = self.served.name
        self.app = create_app(self.served, ServerConfig(**config))
        self.thread = ServerThread(self.app).start()
        self.url = self.thread.url

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metric(self, sample: str) -> float:
        """The value of one exposition line, e.g. `k3stream_generation_tokens_total`."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(sample)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health()["active_sequences"]:
            assert time.monotonic() < deadline, f"sequences still active: {self.health()}"
            time.sleep(0.05)

    def close(self) -> None:
        self.thread.stop()
        self.app.state.scheduler.stop()  # the lifespan did; a no-op then
        self.served.close()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(served_pack, ram_mib):
    live = LiveServer(served_pack, ram_mib, max_batch=MAX_BATCH, max_queue=MAX_QUEUE)
    yield live
    live.close()


@pytest.fixture(scope="module")
def slow_server(served_pack, ram_mib):
    """The same model with every pack read slowed by a fixed sleep, so that a request of a few dozen
    tokens lasts long enough, on any machine, for concurrent requests and disconnects to meet it."""
    live = LiveServer(
        served_pack,
        ram_mib,
        StoreOptions(simulated_read_latency_us=SLOW_READ_US),
        max_batch=MAX_BATCH,
        max_queue=MAX_QUEUE,
    )
    yield live
    live.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gguf_model(tiny_gguf):
    """`(model, tokenizer)` with the experts read from the GGUF (no expert store)."""
    import k3stream
    from k3stream.engine.tokenizer import Tokenizer

    return k3stream.load(tiny_gguf), Tokenizer.from_gguf(tiny_gguf)


@pytest.fixture(scope="module")
def reference(gguf_model):
    """Greedy generation by the engine's loop on the model with experts read from the GGUF."""
    from k3stream.engine.generate import generate
    from k3stream.engine.sampling import SamplingParams

    model, tokenizer = gguf_model

    def run(prompt_ids, max_tokens):
        return generate(model, tokenizer, prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))

    return run


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.name]


def test_completion_greedy_matches_the_engine_loop(client, server, reference):
    prompt = "The quick brown fox"
    result = client.completions.create(model=server.name, prompt=prompt, max_tokens=12, temperature=0)
    expected = reference(server.served.encode_prompt(prompt), 12)
    choice = result.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(server.served.encode_prompt(prompt))
    assert result.usage.completion_tokens == expected.completion_tokens
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    as_ids = client.completions.create(
        model=server.name, prompt=server.served.encode_prompt(prompt), max_tokens=12, temperature=0
    )
    assert as_ids.choices[0].text == expected.text


def test_several_prompts_are_answered_prompt_major_with_usage_over_all(client, server, reference):
    """OpenAI's batch of prompts (LangChain's `OpenAI` sends one): choice `i * n + j` is prompt i's
    choice j; usage counts every prompt; texts and token-id lists alike; streamed as whole."""
    prompts = ["The quick brown fox", "Once upon a time there"]
    ids = [server.served.encode_prompt(prompt) for prompt in prompts]
    expected = [reference(prompt_ids, 6).text for prompt_ids in ids]
    for prompt in (prompts, ids):
        result = client.completions.create(model=server.name, prompt=prompt, max_tokens=6, temperature=0, n=2)
        assert [choice.index for choice in result.choices] == [0, 1, 2, 3]
        assert [choice.text for choice in result.choices] == [text for text in expected for _ in range(2)]
        assert result.usage.prompt_tokens == sum(map(len, ids))
        assert result.usage.completion_tokens == sum(reference(p, 6).completion_tokens for p in ids) * 2
    chunks = client.completions.create(
        model=server.name,
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    assert chunk.usage.prompt_tokens == sum(map(len, ids))


def test_streamed_chat_equals_the_whole_answer(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=server.name, messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=server.name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(server.served.encode_chat(messages))


def test_sse_stream_ends_with_done(server):
    body = {"model": server.name, "prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)
    payloads = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert {p["object"] for p in payloads} == {"text_completion"}


def test_model_field_may_be_left_out(client, server):
    """As with vLLM and llama.cpp's server, no `model` means the one model this server serves."""
    named = client.completions.create(model=server.name, prompt="abc", max_tokens=4, temperature=0)
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0}, timeout=30
    )
    assert response.status_code == 200
    assert response.json()["model"] == server.name
    assert response.json()["choices"][0]["text"] == named.choices[0].text


def test_stop_string_truncates_before_it(client, server):
    prompt = "Once upon a time"
    free = client.completions.create(model=server.name, prompt=prompt, max_tokens=16, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 4, f"tiny model produced too little text to place a stop string: {text!r}"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.completions.create(
        model=server.name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_max_tokens_bounds_the_output(client, server):
    result = client.completions.create(model=server.name, prompt="count", max_tokens=5, temperature=0)
    assert result.usage.completion_tokens <= 5
    if result.choices[0].finish_reason == "length":
        assert result.usage.completion_tokens == 5


def test_seeded_sampling_is_reproducible(client, server):
    def draw(seed):
        return (
            client.completions.create(
                model=server.name, prompt="Pick", max_tokens=10, temperature=1.0, top_p=0.9, seed=seed
            )
            .choices[0]
            .text
        )

    assert draw(1234) == draw(1234)


def _completion(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_batched_outputs_equal_solo_outputs(server, slow_server):
    """Solo answers from one server; the same requests sent together to the same model whose slowed
    reads make them overlap, so the scheduler decodes them in shared steps."""
    prompts = ["alpha beta", "The rain in Spain", "1 2 3 4", "Hello, world"]
    assert len(prompts) == MAX_BATCH

    def body(prompt):
        return {
            "model": server.name,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }

    solo = [_completion(server.url, body(p)).json()["choices"][0]["text"] for p in prompts]
    slow_server.wait_idle()
    before = slow_server.health()["batched_steps"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = [
            r.json()["choices"][0]["text"]
            for r in pool.map(lambda p: _completion(slow_server.url, body(p)), prompts)
        ]
    assert together == solo
    assert slow_server.health()["batched_steps"] > before, "the requests were never decoded together"


def test_a_budget_of_one_working_set_still_decodes_requests_together(server, served_pack):
    """A store that holds one top-k working set serves a batch whose experts outgrow it (the MoE
    fetches a step's experts in groups the cache holds, each read once): concurrent requests share
    decode steps and answer as they do alone (the batch was capped at one sequence, the requests
    queued one after another and each read its experts on its own)."""
    from k3stream.pack.reader import ExpertPack

    with ExpertPack(served_pack) as pack:
        one_working_set = pack.top_k * pack.object_bytes / (1 << 20)
    small = LiveServer(
        served_pack,
        one_working_set,
        StoreOptions(simulated_read_latency_us=SLOW_READ_US),
        max_batch=MAX_BATCH,
        max_queue=MAX_QUEUE,
    )
    try:
        prompts = ["alpha beta", "The rain in Spain", "1 2 3 4"]
        body = dict(model=server.name, max_tokens=12, temperature=0, ignore_eos=True)
        solo = [_completion(server.url, dict(body, prompt=p)).json()["choices"][0]["text"] for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = pool.map(lambda p: _completion(small.url, dict(body, prompt=p)).json(), prompts)
            together = [answer["choices"][0]["text"] for answer in answers]
        assert together == solo
        assert small.health()["batched_steps"] > 0, "the requests were never decoded together"
    finally:
        small.close()


BAD_BODIES = [
    ("malformed json", b'{"model": "x", "prompt": ', "invalid_json"),
    ("not an object", b"[1, 2, 3]", None),
    ("max_tokens string", {"prompt": "hi", "max_tokens": "ten"}, None),
    ("temperature string", {"prompt": "hi", "temperature": "hot"}, None),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}, None),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -5}, None),
    ("zero max_tokens", {"prompt": "hi", "max_tokens": 0}, None),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**12}, None),
    ("prompt longer than the context", {"prompt": "word " * 600}, "context_length_exceeded"),
    ("token ids outside the vocabulary", {"prompt": [1, 2, 10**9]}, None),
    ("missing prompt", {"max_tokens": 3}, None),
    ("n above the batch", {"prompt": "hi", "n": MAX_BATCH + 1}, None),
    ("n zero", {"prompt": "hi", "n": 0}, None),
    ("an empty prompt of two", {"prompt": ["a", ""]}, None),
    ("stop of wrong type", {"prompt": "hi", "stop": 5}, None),
    ("stream not a bool", {"prompt": "hi", "stream": "yes"}, None),
]


@pytest.mark.parametrize(("case", "body", "code"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_completion_requests_get_openai_errors(server, case, body, code):
    if isinstance(body, dict):
        body = json.dumps({"model": server.name, **body}).encode()
    response = httpx.post(
        server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code


def test_any_model_name_is_served_by_the_served_model_as_in_llama_server(client, server):
    """llama-server answers every request with its one model, whatever `model` names (clients send
    `gpt-4o`, `claude-...`); the response's `model` names the model that answered."""
    asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    served = client.chat.completions.create(model=server.name, **asked)
    other = client.chat.completions.create(model="gpt-4o", **asked)
    assert other.model == served.model == server.name
    assert other.choices[0].message.content == served.choices[0].message.content
    completion = client.completions.create(model="no-such-model", prompt="hi", max_tokens=2, temperature=0)
    assert completion.model == server.name and completion.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as not_found:  # asking for a model card by name still checks it
        client.models.retrieve("no-such-model")
    assert not_found.value.body["code"] == "model_not_found"


def test_integral_floats_are_taken_for_integer_fields_as_llama_server_takes_them(server):
    """`"max_tokens": 2.0` (JavaScript and float variables write it) is 2, as llama-server and vLLM read
    it; `2.5` is a 400 naming the field (llama-server would cut it to 2 without a word)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    for fields, tokens in (({"max_tokens": 2.0}, 2), ({"n_predict": 5.0, "seed": 7.0, "n": 1.0}, 5)):
        response = httpx.post(server.url + "/v1/chat/completions", json={**chat, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == tokens
    native = httpx.post(
        server.url + "/completion", json={"prompt": "hi", "n_predict": 3.0, "ignore_eos": True}, timeout=60
    )
    assert native.status_code == 200 and native.json()["tokens_predicted"] == 3, native.text
    for name in ("max_tokens", "n_predict", "top_k"):
        refused = httpx.post(server.url + "/v1/chat/completions", json={**chat, name: 2.5}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


def test_bad_chat_requests(client, server):
    for messages in ([], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 42}]):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=server.name, messages=messages)
        assert bad.value.body["param"].startswith("messages")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi " * 600}])
    # an agent's legacy `function_call` turn has neither content nor tool_calls: the 400 reads as English
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": "hi"}, legacy]
        )
    assert bad.value.body["message"] == (
        "messages.1.content: a message of role 'assistant' needs its content or tool_calls"
    )
    answer = client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_past_the_context_is_cut_where_the_context_ends(client, server):
    """Agents (Cline, OpenCode) ask for 32000 tokens whatever the prompt and `--ctx`: as llama-server
    cuts it (vLLM and OpenAI answer a 400), chat and completions answer up to the context's end with
    finish_reason `length`, the answer max_tokens of the room left gives, streamed or whole."""
    asked = {"model": server.name, "temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    whole = client.chat.completions.create(messages=messages, max_tokens=32000, **asked)
    room = CTX - whole.usage.prompt_tokens
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", room)
    exact = client.chat.completions.create(messages=messages, max_tokens=room, **asked)
    assert exact.choices[0].message.content == whole.choices[0].message.content
    newer = client.chat.completions.create(messages=messages, max_completion_tokens=32000, **asked)
    assert newer.choices[0].message.content == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=32000, stream=True, **asked))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    completion = client.completions.create(prompt="Rivers run", max_tokens=32000, **asked)
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == CTX
    assert completion.choices[0].finish_reason == "length"


def test_a_prompt_of_exactly_the_context_is_refused_for_leaving_no_room_for_an_answer(client, server):
    """A prompt of `ctx` tokens fits the context, so "the prompt has N tokens" alone reads as no reason:
    the 400 says the answer has no room (one token less is answered with one token)."""
    asked = {"model": server.name, "max_tokens": 5, "temperature": 0}
    one_short = client.completions.create(prompt=[5] * (CTX - 1), **asked)
    assert (one_short.usage.completion_tokens, one_short.choices[0].finish_reason) == (1, "length")
    for length, says_no_room in ((CTX, True), (CTX + 1, False)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(prompt=[5] * length, **asked)
        message = refused.value.body["message"]
        assert f"maximum context length is {CTX} tokens" in message and f"has {length} tokens" in message
        assert ("no room for an answer" in message) == says_no_room, message


def test_unknown_route_answers_an_openai_error(server):
    response = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def long_story(server, **fields) -> dict:
    """A completion request that generates 200 tokens unless cancelled."""
    body = {"model": server.name, "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0}
    return {**body, "ignore_eos": True, **fields}


def test_disconnect_mid_stream_frees_the_sequence(slow_server):
    slow_server.wait_idle()
    cancelled_before = slow_server.health()["cancelled_jobs"]
    generated_before = slow_server.metric("k3stream_generation_tokens_total")
    body = long_story(slow_server, stream=True)
    with httpx.stream("POST", slow_server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(3)]
    assert all(line.startswith("data: ") or not line for line in received)
    slow_server.wait_idle(timeout=20)
    assert slow_server.health()["cancelled_jobs"] == cancelled_before + 1
    assert slow_server.metric("k3stream_generation_tokens_total") - generated_before < 200


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_sequence(slow_server):
    """A client that gives up (its read timeout) frees its sequence; the request counts as nginx's 499
    (client closed request), not as a 500 with a traceback in the log."""
    slow_server.wait_idle()
    cancelled_before = slow_server.health()["cancelled_jobs"]
    generated_before = slow_server.metric("k3stream_generation_tokens_total")
    closed_before, failed_before = (_completions_answered(slow_server, status) for status in (499, 500))
    body = long_story(slow_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    slow_server.wait_idle(timeout=20)
    assert slow_server.health()["cancelled_jobs"] == cancelled_before + 1
    assert slow_server.metric("k3stream_generation_tokens_total") - generated_before < 200
    deadline = time.monotonic() + 10
    while _completions_answered(slow_server, 499) == closed_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _completions_answered(slow_server, 499) == closed_before + 1
    assert _completions_answered(slow_server, 500) == failed_before


def _completions_answered(server: LiveServer, status: int) -> float:
    """/metrics' count of /v1/completions requests answered with `status`."""
    try:
        return server.metric(f'k3stream_requests_total{{endpoint="/v1/completions",status="{status}"}}')
    except KeyError:
        return 0.0


def test_full_queue_refuses_with_429(slow_server):
    """Twelve requests at once: the batch slots and the queue hold eight, the rest are refused."""
    slow_server.wait_idle()
    body = {
        "model": slow_server.name,
        "prompt": "Go on and on",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: _completion(slow_server.url, body), range(12)))
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= MAX_BATCH + MAX_QUEUE
    assert statuses.count(429) >= 1
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status_code == 429)
    assert slow_server.health()["peak_waiting"] >= MAX_QUEUE
    slow_server.wait_idle()


def _scheduler_job(tokenizer, loop, max_tokens: int, prompt: str = "Hello"):
    from k3stream.engine.generate import Sequence
    from k3stream.engine.sampling import SamplingParams
    from k3stream.server.scheduler import EventSink, Job

    ids = tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Job(ids, Sequence(tokenizer, ids, params), EventSink(loop))


def test_scheduler_without_a_queue_fills_its_free_batch_slots(gguf_model):
    """`max_queue=0` still takes as many requests as there are free batch slots; then it refuses."""
    import asyncio

    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import ErrorEvent, QueueFull, Scheduler

    model, tokenizer = gguf_model
    loop = asyncio.new_event_loop()

    def job(max_tokens):
        return _scheduler_job(tokenizer, loop, max_tokens)

    scheduler = Scheduler(model, ServerMetrics(), max_batch=2, max_queue=0)
    short, long = job(2), job(10_000)
    scheduler.submit(short)
    scheduler.submit(long)
    with pytest.raises(QueueFull, match="the request queue is full"):
        scheduler.submit(job(2))
    scheduler.start()
    try:
        wait_until(
            lambda: short.logic.finish_reason is not None and scheduler.snapshot()["running"] == 1,
            "the short job finished",
        )
        assert short.logic.finish_reason == "length"
        scheduler.submit(job(2))  # the finished one's slot is free again
    finally:
        scheduler.stop()
    steps = scheduler.snapshot()["steps"]
    time.sleep(0.05)
    assert scheduler.snapshot()["steps"] == steps, "the scheduler thread ran on after stop()"
    loop.run_until_complete(asyncio.sleep(0))
    events = [long.sink.queue.get_nowait()[1] for _ in range(long.sink.queue.qsize())]
    assert events[-1] == ErrorEvent("the server is shutting down")
    loop.close()


def test_a_slot_action_acts_after_the_requests_before_it_and_before_those_after_it(gguf_model):
    """As llama-server defers a slot task (save, restore, erase) behind a busy slot: an action claiming
    slot 1 may act once the request running there and one that asked for the slot before the action
    have finished and been handed to `on_finish` (their finished states recorded); a request for slot 1
    that came after the action waits until the action is over, while one for any slot runs in slot 0."""
    import asyncio

    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import Scheduler

    model, tokenizer = gguf_model
    loop = asyncio.new_event_loop()
    finished = []
    scheduler = Scheduler(model, ServerMetrics(), max_batch=2, max_queue=4, on_finish=finished.append)
    running, earlier, later, anywhere = (_scheduler_job(tokenizer, loop, n) for n in (200, 2, 2, 2))
    running.wanted_slot = earlier.wanted_slot = later.wanted_slot = 1
    scheduler.start()
    try:
        scheduler.submit(running)
        wait_until(lambda: running.logic.completion_tokens > 0, "the first request decodes")
        scheduler.submit(earlier)
        scheduler.claim_slot(1)
        scheduler.submit(later)
        scheduler.submit(anywhere)
        wait_until(lambda: scheduler.take_slot(1), "slot 1 was free for the action")
        assert running in finished and earlier in finished
        assert later.state is None and later.slot == -1  # not admitted while the action holds the slot
        wait_until(lambda: anywhere in finished, "the request for any slot finished")
        assert anywhere.slot == 0 and later.state is None
        scheduler.release_slot(1)
        wait_until(lambda: later in finished, "the later request ran once the action was over")
        assert later.slot == 1
    finally:
        scheduler.stop()
        loop.close()


class _GatedPrefill:
    """The real model, whose prefill waits for a gate: a request is caught in the middle of it."""

    def __init__(self, model):
        self.model = model
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill(self, state, tokens):
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.model.prefill(state, tokens)


def test_a_request_in_prefill_is_active_and_its_cancellation_counted(gguf_model):
    """/health counts a request while its prompt is prefilled; a client leaving then is counted once."""
    import asyncio

    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import Scheduler

    model, tokenizer = gguf_model
    gated = _GatedPrefill(model)
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(gated, ServerMetrics(), max_batch=2, max_queue=2)
    job = _scheduler_job(tokenizer, loop, 10_000)
    scheduler.start()
    try:
        scheduler.submit(job)
        assert gated.entered.wait(60), "the scheduler never prefilled the request"
        snapshot = scheduler.snapshot()
        assert (snapshot["waiting"], snapshot["running"], snapshot["active_sequences"]) == (0, 1, 1)
        job.cancel()
        scheduler.wake()
        gated.gate.set()
        wait_until(lambda: scheduler.snapshot()["active_sequences"] == 0, "the cancelled job was freed")
        assert scheduler.snapshot()["cancelled_jobs"] == 1
        assert job.logic.completion_tokens <= 1
    finally:
        gated.gate.set()
        scheduler.stop()
        loop.close()


def test_health_and_metrics(client, server):
    client.completions.create(model=server.name, prompt="metrics please", max_tokens=4, temperature=0)
    server.wait_idle()
    health = server.health()
    assert health["status"] == "ok" and health["active_sequences"] == 0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "k3stream_requests_total",
        "k3stream_prompt_tokens_total",
        "k3stream_generation_tokens_total",
        "k3stream_time_to_first_token_seconds_bucket",
        "k3stream_time_per_output_token_seconds_bucket",
        "k3stream_queue_length",
        "k3stream_expert_bytes_read_per_token",
    ):
        assert re.search(rf"^{name}[{{ ]", text, re.M), f"/metrics lacks {name}"
    tiers = set(re.findall(r'^k3stream_expert_hit_rate\{tier="(\w+)"\}', text, re.M))
    assert "ram" in tiers
    assert server.metric('k3stream_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert server.metric("k3stream_expert_bytes_read_per_token") > 0


def test_load_with_random_disconnects_leaks_nothing(server):
    """40 requests from 8 threads, a third of them abandoned mid-stream; only 429s may fail."""
    server.wait_idle()
    rss_before = server.health()["rss_bytes"]
    rng = random.Random(7)
    plans = [(i, rng.random() < 0.35, rng.randint(4, 24)) for i in range(40)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt(index, abandon, max_tokens):
        body = {
            "model": server.name,
            "prompt": f"request {index}: say something",
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": index,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            if response.status_code == 429:
                return "refused"
            if response.status_code != 200:
                return "failed"
            if abandon:
                next(response.iter_lines())
                return "abandoned"
            lines = [line for line in response.iter_lines() if line]
            return "done" if lines[-1] == "data: [DONE]" and "error" not in lines[-2] else "failed"

    def one(plan):
        for _ in range(20):  # a refused client backs off and retries, as Retry-After asks
            outcome = attempt(*plan)
            if outcome != "refused":
                break
            time.sleep(0.1)
        with lock:
            outcomes.append(outcome)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, plans))
    assert "failed" not in outcomes
    assert outcomes.count("done") + outcomes.count("abandoned") >= 30, outcomes
    server.wait_idle(timeout=15)
    health = server.health()
    assert health["active_sequences"] == 0
    assert health["rss_bytes"] - rss_before < 64 << 20


def test_cli_serve_answers(served_pack, ram_mib, tmp_path):
    with ServerProcess(
        served_pack,
        "--ram-mib",
        str(ram_mib),
        "--ctx",
        str(CTX),
        "--threads",
        "1",
        "--policy",
        "lru",
        "--no-prefetch",
        log_path=tmp_path / "serve.log",
    ) as process:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=60)
        [model] = client.models.list().data
        result = client.completions.create(model=model.id, prompt="hi", max_tokens=3, temperature=0)
        assert result.usage.completion_tokens >= 1
        store = httpx.get(process.url + "/health", timeout=10).json()["expert_store"]
        assert store["tiers"]["ram"]["policy"] == "lru"
        assert (store["prefetch"], store["prefetch_loads"]) == (False, 0)
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()  # Ctrl-C shuts down cleanly


def test_a_fresh_servers_first_streamed_requests_import_no_module_and_start_no_thread(served_pack):
    """What a server would load on first use (anyio's asyncio backend for streamed responses, numpy's
    masked arrays behind np.unique in the token hint, the tokenizer and expert-store threads) is there
    before it serves, not inside the first requests' time to first token."""
    worker = Path(__file__).with_name("first_request_worker.py")
    done = subprocess.run(
        [sys.executable, str(worker), str(served_pack)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"imported": [], "threads": []}
