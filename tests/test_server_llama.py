"""llama-server's endpoints (`/tokenize`, `/detokenize`, `/apply-template`, `/props`, `/slots`), SSE
keep-alive comments and prompt progress, against a live server on 127.0.0.1 on a tiny Kimi-K3 GGUF.
Tokens are checked against llama.cpp's tokenizer (llama-cpp-python) on the same file.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from conftest import requires_llama
from k3stream.engine.loading import load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.routes import LLAMA_ENDPOINTS, PUBLIC_PATHS
from k3stream.server.runtime import served_from_runtime

KEY = "sk-test-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEEPALIVE_S = 0.05
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello <b>there</b>"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
TEXTS = ["Hello world", "café naïve 中文 🙂", "<|im_end|>[BOS]x", "  two  spaces\n"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(model_path):
    served = served_from_runtime(load_runtime(model_path), ctx=512)
    yield served
    served.close()


@pytest.fixture(scope="module")
def server(served):
    config = ServerConfig(max_batch=1, guard=GuardConfig(api_key=KEY), sse_keepalive_s=KEEPALIVE_S)
    thread = ServerThread(create_app(served, config)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def llama_vocab(model_path):
    import llama_cpp  # its tests are `requires_llama`

    return llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)


def post(server, path, body, headers=AUTH):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


@requires_llama
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_tokenize_matches_llama_cpp(server, llama_vocab, text, parse_special):
    body = {"content": text, "parse_special": parse_special}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert tokens == list(llama_vocab.tokenize(text.encode(), add_bos=False, special=parse_special))
    with_bos = post(server, "/tokenize", {**body, "add_special": True}).json()["tokens"]
    assert with_bos == list(llama_vocab.tokenize(text.encode(), add_bos=True, special=parse_special))


def test_tokenize_with_pieces_and_detokenize_round_trip(server):
    text = "café naïve 中文 🙂 <|im_end|>"
    tokens = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    ids = [entry["id"] for entry in tokens]
    assert ids == post(server, "/tokenize", {"content": text}).json()["tokens"]
    joined = b"".join(
        entry["piece"].encode() if isinstance(entry["piece"], str) else bytes(entry["piece"])
        for entry in tokens
    )
    assert joined.decode() == text
    assert any(isinstance(entry["piece"], list) for entry in tokens), "no token split a UTF-8 character"
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}


def test_apply_template_is_the_chat_prompt(server, served):
    prompt = post(server, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    assert prompt == served.chat_template.render(MESSAGES)
    ids = post(server, "/tokenize", {"content": prompt, "add_special": False}).json()["tokens"]
    answer = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_a_rendered_chat_prompt_completes_as_the_chat_request(server, client):
    """The llama-server workflow: render with /apply-template, send the text to /v1/completions. Its
    special-token text is tokenized as those tokens, so the answer is the chat request's."""
    prompt = post(server, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    ask = {"model": client.models.list().data[0].id, "max_tokens": 6, "temperature": 0}
    completed = client.completions.create(prompt=prompt, **ask)
    chat = client.chat.completions.create(messages=MESSAGES, **ask)
    assert completed.usage.prompt_tokens == chat.usage.prompt_tokens
    assert completed.choices[0].text == chat.choices[0].message.content


def test_a_last_assistant_message_is_continued_as_llama_server_prefills(server, client):
    """A conversation ending with the assistant's message: the answer continues that text (llama-server's
    assistant prefill); /apply-template renders the same prompt, open at the end."""
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    prompt = post(server, "/apply-template", {"messages": prefilled}).json()["prompt"]
    opened = post(server, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    assert prompt == opened + "Sure, here"
    ids = post(server, "/tokenize", {"content": prompt}).json()["tokens"]
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=prefilled, max_tokens=6, temperature=0
    )
    continued = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == continued["choices"][0]["text"]


def test_openai_paths_without_v1_answer_as_in_llama_server(server, client):
    """A client whose base URL lacks /v1 (llama-server answers both) gets the same answers; `/completions`
    is llama-server's native completion there, as in llama-server."""
    bare = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    assert bare.models.list().data == client.models.list().data
    ask = {"model": bare.models.list().data[0].id, "max_tokens": 4, "temperature": 0}
    native = post(server, "/completions", {"prompt": "Hello", **ask}).json()
    assert native["content"] == client.completions.create(prompt="Hello", **ask).choices[0].text
    assert "choices" not in native and native["tokens_predicted"] == 4
    answer = bare.chat.completions.create(messages=MESSAGES, **ask)
    assert (
        answer.choices[0].message
        == client.chat.completions.create(messages=MESSAGES, **ask).choices[0].message
    )


def test_openai_model_retrieval_and_unknown_routes(server, client, served):
    assert httpx.get(f"{server.url}/v1/models/{served.name}", timeout=10).status_code == 401
    card = client.models.retrieve(served.name)
    assert card.id == served.name and card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["param"] == "model" and "gpt-4" in caught.value.body["message"]
    for method, path, status, words in (
        ("POST", "/v1/completion", 404, "POST /v1/completion: no such endpoint"),
        ("POST", "/v1/audio/speech", 404, "POST /v1/audio/speech: no such endpoint"),
        ("GET", "/v1/chat/completions", 405, "takes POST"),
    ):
        response = httpx.request(method, server.url + path, json={}, headers=AUTH, timeout=30)
        error = response.json()["error"]
        assert response.status_code == status and words in error["message"] and "\n" not in error["message"]
    assert httpx.get(server.url + "/v1/completions", headers=AUTH).headers["allow"] == "POST"


def test_props_describe_the_model(server, served, model_path):
    props = httpx.get(server.url + "/props", headers=AUTH, timeout=10).json()
    assert props["model_path"] == model_path.name and props["model_alias"] == served.name
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0
    assert props["total_slots"] == 1
    assert props["chat_template"] == served.chat_template.template_text
    assert props["build_info"].startswith("k3stream ")
    assert "/" not in props["model_path"]


def _stream_lines(server, body, lines, started=None):
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as reply:
        if started is not None:
            started.set()
        for line in reply.iter_lines():
            lines.append((time.monotonic(), line))


def test_slots_list_the_one_slot_with_the_running_sequence_and_then_the_last_one(server, served):
    """With --max-batch 1 there is one slot: the running sequence is under it while a second request waits
    in the queue (in no slot, as llama-server queues tasks); once both finish, the slot shows the last."""
    long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines: list = []
    started = threading.Event()
    runner = threading.Thread(target=_stream_lines, args=(server, long, lines, started), daemon=True)
    runner.start()
    started.wait(30)
    waiting = threading.Thread(
        target=lambda: post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), daemon=True
    )
    waiting.start()
    busy = _poll_slots(server, lambda s: isinstance(s, dict), "?fail_on_no_slot=1")  # the one slot runs
    assert busy["error"] == {"code": 503, "message": "no slot available", "type": "unavailable_error"}
    _poll_metrics(server, {"llamacpp:requests_processing": 1.0, "llamacpp:requests_deferred": 1.0})
    (slot,) = _poll_slots(server, lambda s: s[0]["is_processing"] and s[0]["next_token"][0]["n_decoded"] > 0)
    assert slot["id"] == 0 and slot["n_ctx"] == served.ctx and slot["speculative"] is False
    assert "prompt" not in slot and "generated" not in slot  # llama-server's texts are off by default
    assert slot["n_prompt_tokens"] == len(served.encode_prompt("Once upon a time"))
    assert slot["n_prompt_tokens_processed"] + slot["n_prompt_tokens_cache"] == slot["n_prompt_tokens"]
    step = slot["next_token"][0]
    assert step["has_next_token"] and step["n_remain"] == 400 - step["n_decoded"]
    assert slot["params"]["max_tokens"] == 400
    runner.join(120)
    waiting.join(60)
    (last,) = _poll_slots(server, lambda s: not s[0]["is_processing"])
    assert last["id_task"] > slot["id_task"] and last["params"]["max_tokens"] == 2
    assert last["n_prompt_tokens"] == len(served.encode_prompt("Hi"))
    assert last["next_token"][0]["has_next_token"] is False


def test_slots_show_the_prompt_and_generated_text_under_llama_servers_debug_switch(served, monkeypatch):
    """With `LLAMA_SERVER_SLOTS_DEBUG=1`, as llama-server, each slot also shows its request's prompt (the
    ids as text, special tokens written out) and the text generated so far; once the request ends, the
    slot keeps both, the generated text the whole response."""
    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
    config = ServerConfig(max_batch=1, guard=GuardConfig(api_key=KEY))
    debug = ServerThread(create_app(served, config)).start()
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        replies: list = []
        runner = threading.Thread(target=lambda: replies.append(post(debug, "/v1/completions", body)))
        runner.start()
        (slot,) = _poll_slots(debug, lambda s: s[0]["is_processing"] and s[0].get("generated"))
        runner.join(120)
        text = replies[0].json()["choices"][0]["text"]
        (last,) = _poll_slots(debug, lambda s: not s[0]["is_processing"] and "generated" in s[0])
    finally:
        debug.stop()
    prompt = served.tokenizer.decode(served.encode_prompt("Once upon a time"))
    assert slot["prompt"] == last["prompt"] == prompt and prompt.endswith("Once upon a time")
    assert slot["generated"] and text.startswith(slot["generated"]) and len(slot["generated"]) < len(text)
    assert last["generated"] == text and last["next_token"][0]["n_decoded"] == 200


@pytest.mark.parametrize("value, shown", [("0", False), ("abc", False), ("2", True), (" 1x", True)])
def test_the_slots_debug_switch_is_read_as_llama_server_reads_it(monkeypatch, value, shown):
    """llama-server reads `LLAMA_SERVER_SLOTS_DEBUG` with atoi: leading digits, else 0."""
    from k3stream.server.slots import slots_debug

    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", value)
    assert slots_debug() is shown


def test_metrics_count_tokens_under_llama_servers_names_too(server):
    """llama-server's dashboards read `llamacpp:prompt_tokens_total` (prompt tokens computed) and
    `llamacpp:tokens_predicted_total`: the same counts as k3stream's own counters, moved by a request."""

    before = metric_values(server)
    body = {
        "prompt": "A prompt nobody sent before",
        "max_tokens": 5,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    reply = post(server, "/v1/completions", body).json()
    after = metric_values(server)
    for llama, own, added in (
        ("llamacpp:prompt_tokens_total", "k3stream_prompt_tokens_total", reply["usage"]["prompt_tokens"]),
        ("llamacpp:tokens_predicted_total", "k3stream_generation_tokens_total", 5),
    ):
        assert after[llama] - before[llama] == after[own] - before[own] == added, (llama, before, after)


def test_metrics_have_llama_servers_times_and_throughputs(server):
    """Dashboards written for llama-server divide `llamacpp:tokens_predicted_total` by
    `llamacpp:tokens_predicted_seconds_total` (and the prompt's likewise) and read its throughput
    gauges and decode count: each moves with a request, and the gauges are those quotients."""

    before = metric_values(server)
    body = {
        "prompt": "Yet another prompt nobody sent",
        "max_tokens": 6,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    post(server, "/v1/completions", body)
    metrics = metric_values(server)
    for name in ("llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"):
        assert metrics[name] > before.get(name, 0.0), name
    assert metrics["llamacpp:n_decode_total"] - before.get("llamacpp:n_decode_total", 0.0) >= 5
    for gauge, tokens, seconds in (
        ("llamacpp:prompt_tokens_seconds", "llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"),
        (
            "llamacpp:predicted_tokens_seconds",
            "llamacpp:tokens_predicted_total",
            "llamacpp:tokens_predicted_seconds_total",
        ),
    ):
        assert metrics[gauge] == pytest.approx(metrics[tokens] / metrics[seconds], rel=1e-6), gauge


def metric_values(server) -> dict[str, float]:
    """Every sample `/metrics` shows, by name."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^([\w:]+) (\S+)$", text, re.M)}


def _poll_metrics(server, wanted):
    for _ in range(3000):  # a bound, not a timing assertion
        values = metric_values(server)
        if all(values.get(name) == value for name, value in wanted.items()):
            return
        time.sleep(0.005)
    raise AssertionError(f"/metrics never showed {wanted}: {[values.get(name) for name in wanted]}")


def _poll_slots(server, condition, query=""):
    for _ in range(3000):  # a bound, not a timing assertion
        slots = httpx.get(server.url + "/slots" + query, headers=AUTH, timeout=10).json()
        if condition(slots):
            return slots
        time.sleep(0.005)
    raise AssertionError(f"/slots never showed the expected sequences: {slots}")


def test_waiting_stream_gets_keep_alive_comments(server, client, served):
    """With one batch slot busy, a second stream waits in the queue: comment lines keep it alive, and
    the openai client reads such a stream as usual."""
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}
    second: list = []
    _while_busy(server, lambda: _stream_lines(server, body, second))
    comments = [at for at, line in second if line == ": keep-alive"]
    assert comments, "no keep-alive comment while the request waited"
    data = [at for at, line in second if line.startswith("data: ") and '"text": ""' not in line]
    assert max(comments) <= min(data), "keep-alive comments came after the answer began"
    chunks = [json.loads(line[6:]) for _, line in second if line.startswith("data: {")]
    raw_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    streamed: list = []
    fields = {k: v for k, v in body.items() if k != "stream"}
    _while_busy(
        server, lambda: streamed.extend(client.completions.create(model=served.name, stream=True, **fields))
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == raw_text


def _while_busy(server, call):
    """`call()` while a long generation holds the server's one batch slot."""
    long = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    started = threading.Event()
    runner = threading.Thread(target=_stream_lines, args=(server, long, [], started), daemon=True)
    runner.start()
    started.wait(30)
    call()
    runner.join(120)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_return_progress_streams_prompt_progress(server, served):
    prompt = "The quick brown fox"
    lines: list = []
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "return_progress": True}
    _stream_lines(server, body, lines)
    chunks = [json.loads(line[6:]) for _, line in lines if line.startswith("data: {")]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    total = len(served.encode_prompt(prompt))
    assert [p["processed"] for p in progress] == [0, total]
    assert all(p["total"] == total and p["time_ms"] >= 0 for p in progress)
    assert all(c["choices"] == [] for c in chunks if "prompt_progress" in c)
    plain: list = []
    _stream_lines(server, {**body, "return_progress": False}, plain)
    assert not any("prompt_progress" in line for _, line in plain)


@pytest.mark.parametrize("path", sorted(LLAMA_ENDPOINTS - PUBLIC_PATHS))
def test_llama_endpoints_need_the_api_key(server, path):
    bodies = {
        "/tokenize": {"content": "hi"},
        "/detokenize": {"tokens": [1]},
        "/apply-template": {"messages": MESSAGES},
        "/completion": {"prompt": "hi", "n_predict": 1},
        "/completions": {"prompt": "hi", "n_predict": 1},
        "/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
    }
    unserved = ("/infill", "/embedding", "/embeddings", "/rerank", "/reranking")  # llama-server's 501
    method = "POST" if path in bodies or path in unserved else "GET"

    def call(headers):
        return httpx.request(method, server.url + path, json=bodies.get(path), headers=headers, timeout=10)

    assert call({}).status_code == 401
    assert call({"Authorization": "Bearer wrong"}).status_code == 401
    assert call(AUTH).status_code == (501 if path in unserved else 200)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/apply-template", {"messages": []}, "messages"),
        ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            "/apply-template",
            {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        (
            "/apply-template",
            {"messages": [{"role": "user", "content": [IMAGE]}]},
            "messages.0.content.0.type",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [IMAGE]}]},
            "messages.0.content.0.type",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [*MESSAGES, {"role": "assistant", "content": "{"}],
                "response_format": {"type": "json_object"},
            },
            "messages.2",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": None}, *MESSAGES]},
            "messages.0.content",
        ),
        (
            "/apply-template",
            {"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c"}]},
            "messages.2.content",
        ),
        ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "assistant"}]}, "messages.2.content"),
    ],
)
def test_bad_bodies_are_one_line_400s_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    if param.endswith(".type"):
        assert "'image_url' parts are not supported" in error["message"]


def test_answers_carry_llama_server_timings(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 5, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()
    timings, usage = whole["timings"], whole["usage"]
    assert (
        timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
        and timings["predicted_n"] == usage["completion_tokens"]
    )
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(5 / timings["predicted_ms"] * 1000)
    lines: list = []
    _stream_lines(server, {**body, "n": 1, "stream": True, "stream_options": {"include_usage": True}}, lines)
    last = json.loads([line for _, line in lines if line.startswith("data: {")][-1][6:])
    assert last["usage"]["completion_tokens"] == 5 and last["timings"]["predicted_n"] == 5
