"""llama-server's endpoints (`/tokenize`, `/detokenize`, `/apply-template`, `/props`, `/slots`), SSE
keep-alive comments and prompt progress, against a live server on 127.0.0.1 on a tiny Kimi-K3 GGUF.
Tokens are checked against llama.cpp's tokenizer (llama-cpp-python) on the same file.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import requires_llama
from k3stream.engine.loading import load_runtime
from k3stream.server.routes import LLAMA_ENDPOINTS, PUBLIC_PATHS
from k3stream.server.runtime import served_from_runtime
from live_server import keyed_server

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
    with keyed_server(served, KEY, max_batch=1, sse_keepalive_s=KEEPALIVE_S) as thread:
        yield thread


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
    closed = post(server, "/apply-template", {"messages": MESSAGES, "add_generation_prompt": False})
    assert closed.json()["prompt"] == served.chat_template.render(MESSAGES, add_generation_prompt=False)
    assert prompt.startswith(closed.json()["prompt"]) and len(prompt) > len(closed.json()["prompt"])
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
    """Read a completion stream's lines; `started` is set at its first data line (its request runs: the
    headers alone come before the scheduler has it, when a request sent next could still go first)."""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as reply:
        for line in reply.iter_lines():
            lines.append((time.monotonic(), line))
            if started is not None and line.startswith("data: "):
                started.set()


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
    with keyed_server(served, KEY, max_batch=1) as debug:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        replies: list = []
        runner = threading.Thread(target=lambda: replies.append(post(debug, "/v1/completions", body)))
        runner.start()
        (slot,) = _poll_slots(debug, lambda s: s[0]["is_processing"] and s[0].get("generated"))
        runner.join(120)
        text = replies[0].json()["choices"][0]["text"]
        (last,) = _poll_slots(debug, lambda s: not s[0]["is_processing"] and "generated" in s[0])
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
    before, reply, after = _metrics_around(server, "A prompt nobody sent before", 5)
    for llama, own, added in (
        ("llamacpp:prompt_tokens_total", "k3stream_prompt_tokens_total", reply["usage"]["prompt_tokens"]),
        ("llamacpp:tokens_predicted_total", "k3stream_generation_tokens_total", 5),
    ):
        assert after[llama] - before[llama] == after[own] - before[own] == added, (llama, before, after)


def test_metrics_have_llama_servers_times_and_throughputs(server):
    """Dashboards written for llama-server divide `llamacpp:tokens_predicted_total` by
    `llamacpp:tokens_predicted_seconds_total` (and the prompt's likewise) and read its throughput
    gauges, decode count, busy slots per decode and largest pass: each moves with a request, and the
    throughputs are those quotients."""
    before, _, metrics = _metrics_around(server, "Yet another prompt nobody sent", 6)
    for name in ("llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"):
        assert metrics[name] > before.get(name, 0.0), name
    assert metrics["llamacpp:n_decode_total"] - before.get("llamacpp:n_decode_total", 0.0) >= 5
    prompt_tokens = metrics["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
    assert metrics["llamacpp:n_tokens_max"] >= prompt_tokens >= 1  # that prompt's prefill pass, at least
    assert metrics["llamacpp:n_busy_slots_per_decode"] == 1.0  # one slot: every decode step holds one
    for gauge, tokens, seconds in (
        ("llamacpp:prompt_tokens_seconds", "llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"),
        (
            "llamacpp:predicted_tokens_seconds",
            "llamacpp:tokens_predicted_total",
            "llamacpp:tokens_predicted_seconds_total",
        ),
    ):
        assert metrics[gauge] == pytest.approx(metrics[tokens] / metrics[seconds], rel=1e-6), gauge


def _metrics_around(server, prompt: str, tokens: int) -> tuple[dict[str, float], dict, dict[str, float]]:
    """`/metrics` before and after a completion of `tokens` tokens of `prompt`, computed whole (not
    restored from the prompt cache), and its answer."""
    before = metric_values(server)
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "cache_prompt": False}
    reply = post(server, "/v1/completions", body).json()
    return before, reply, metric_values(server)


def metric_values(server) -> dict[str, float]:
    """Every sample `/metrics` shows, by name."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^([\w:]+) (\S+)$", text, re.M)}


def _poll_metrics(server, wanted):
    def shown(values):
        return all(values.get(name) == value for name, value in wanted.items())

    _poll(lambda: metric_values(server), shown, f"/metrics showing {wanted}")


def _poll_slots(server, condition, query=""):
    return _poll(
        lambda: httpx.get(server.url + "/slots" + query, headers=AUTH, timeout=10).json(),
        condition,
        "/slots showing the expected sequences",
    )


def _poll(read, done, what):
    """`read()` until `done` holds of its value (3,000 reads at most: a bound, not a timing assertion)."""
    for _ in range(3000):
        value = read()
        if done(value):
            return value
        time.sleep(0.005)
    raise AssertionError(f"never saw {what}; the last read: {value}")


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


@pytest.mark.parametrize(("interval", "comments"), [(-1, False), (600, False), (KEEPALIVE_S, True)])
def test_a_requests_sse_ping_interval_sets_its_keep_alive_comments(server, interval, comments):
    """llama-server's `sse_ping_interval`: a stream's own seconds between keep-alive comments over the
    server's (-1: none), here while it waits for the busy batch slot; out of range is a 400."""
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "temperature": 0, "sse_ping_interval": interval}
    lines: list = []
    _while_busy(server, lambda: _stream_lines(server, body, lines))
    assert any(line == ": keep-alive" for _, line in lines) == comments
    assert "data: [DONE]" in [line for _, line in lines]
    refused = httpx.post(server.url + "/v1/completions", json={**body, "sse_ping_interval": 0}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sse_ping_interval"


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
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "reasoning_format": "deepseek-legacy"},
            "reasoning_format",
        ),
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
    assert timings["predicted_per_token_ms"] == pytest.approx(timings["predicted_ms"] / 5)
    assert timings["prompt_per_token_ms"] == pytest.approx(timings["prompt_ms"] / timings["prompt_n"])
    lines: list = []
    _stream_lines(server, {**body, "n": 1, "stream": True, "stream_options": {"include_usage": True}}, lines)
    last = json.loads([line for _, line in lines if line.startswith("data: {")][-1][6:])
    assert last["usage"]["completion_tokens"] == 5 and last["timings"]["predicted_n"] == 5
    chat = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "stream": True}
    chunks = [json.loads(line[6:]) for line in post(server, "/v1/chat/completions", chat).text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    finish = chunks[-1]  # no usage chunk without include_usage: llama-server's timings are here
    assert finish["choices"][0]["finish_reason"] == "length" and finish["timings"]["predicted_n"] == 4


def test_props_say_which_endpoints_are_on_and_post_props_needs_the_flag(server, served):
    """llama-server's `/props` tells a client which optional endpoints run and the special tokens; `POST
    /props` is its 501 without `--props`."""
    props = httpx.get(server.url + "/props", headers=AUTH, timeout=10).json()
    assert (props["endpoint_slots"], props["endpoint_props"], props["endpoint_metrics"]) == (
        True,
        False,
        True,
    )
    assert props["webui"] is True
    tokenizer = served.tokenizer
    assert props["bos_token"] == tokenizer.decode([tokenizer.bos_id]) and props["bos_token"]
    assert props["eos_token"] == tokenizer.decode([tokenizer.eos_id]) and props["eos_token"]
    refused = post(server, "/props", {})
    assert refused.status_code == 501
    assert refused.json() == {
        "error": {
            "code": 501,
            "message": "This server does not support changing global properties. Start it with `--props`",
            "type": "not_supported_error",
        }
    }


# llama.cpp's figures of a model file, in a process of its own (as `llama_oracle`: llama.cpp and torch
# in one process can crash)
LLAMA_META = """
import json, sys
import llama_cpp
llama = llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)
model = llama._model
print(json.dumps({"vocab_type": llama_cpp.LLAMA_VOCAB_TYPE_BPE, "n_vocab": llama.n_vocab(),
    "n_ctx_train": model.n_ctx_train(), "n_embd": model.n_embd(), "n_params": model.n_params(),
    "size": model.size()}))
llama.close()
"""


@requires_llama
def test_model_cards_carry_llama_servers_meta(server, client, served, model_path):
    """Clients read the model's training context and size from `/v1/models`' `meta`, as llama-server
    fills it: the figures llama.cpp reads from the same file."""
    meta = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["meta"]
    assert meta == client.models.retrieve(served.name).meta
    figures = subprocess.run(
        [sys.executable, "-c", LLAMA_META, str(model_path)], capture_output=True, text=True, check=True
    )
    assert meta == {**json.loads(figures.stdout.strip().splitlines()[-1]), "n_ctx": served.ctx}


def test_the_model_list_is_llama_servers_with_its_ollama_entry_and_api_tags_answers_it(server, served):
    """`/v1/models`, `/models` and Ollama's `/api/tags` (open without the key, as llama-server leaves
    them) answer one list: OpenAI's `data` and llama-server's Ollama-style `models` entry naming the
    served model, which the `openai` client lists as ever."""
    lists = [httpx.get(server.url + path, timeout=10) for path in ("/v1/models", "/models", "/api/tags")]
    assert [reply.status_code for reply in lists] == [200] * 3
    answers = [{k: v for k, v in reply.json().items() if k != "data"} for reply in lists]
    assert answers[0] == answers[1] == answers[2]
    (entry,) = answers[0]["models"]
    assert entry["name"] == entry["model"] == served.name
    assert (entry["capabilities"], entry["details"]["format"]) == (["completion"], "gguf")
    assert [card["id"] for reply in lists for card in reply.json()["data"]] == [served.name] * 3
    bare = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    assert [model.id for model in bare.models.list()] == [served.name]
    assert httpx.post(server.url + "/api/tags", timeout=10).status_code == 405


def test_streams_carry_token_ids_and_timings_per_token(server):
    """llama-server streams each piece's token ids (without `return_tokens`), and with
    `timings_per_token` the timings so far on every piece, on `/completion` and the chat endpoint."""
    body = {"prompt": "Once upon", "n_predict": 6, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/completion", {**body, "return_tokens": True}).json()
    lines: list = []
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True,
                      "timings_per_token": True}, headers=AUTH, timeout=120) as reply:  # fmt: skip
        lines = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    pieces = [chunk for chunk in lines if not chunk["stop"]]
    assert [token for piece in pieces for token in piece["tokens"]] == whole["tokens"]
    assert all(piece["timings"]["predicted_n"] >= piece["tokens_predicted"] for piece in pieces)
    assert [piece["tokens_predicted"] for piece in pieces][-1] == 6 and lines[-1]["tokens"] == []
    plain = post(server, "/completion", {**body, "stream": True}).text
    assert '"timings"' not in plain.split("\n\n")[0] and '"tokens": []' not in plain.split("\n\n")[0]
    chat = {"messages": MESSAGES, "max_tokens": 3, "stream": True, "timings_per_token": True}
    chunks = [json.loads(line[6:]) for line in post(server, "/v1/chat/completions", chat).text.split("\n")
              if line.startswith("data: {")]  # fmt: skip
    texts = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["delta"].get("content")]
    assert texts and all(chunk["timings"]["prompt_n"] + chunk["timings"]["cache_n"] > 0 for chunk in texts)


@pytest.fixture(scope="module")
def flagged(model_path, tmp_path_factory):
    """The server `k3stream serve --chat-template-file T --temp 0 -n 3 --seed 11 --no-slots --props
    --chat-template-kwargs '{"greeting": "Ahoy"}' --api-key k1,k2` starts: the settings `serve.run` makes
    of those flags."""
    from k3stream.cli import build_parser
    from k3stream.commands.serve import request_defaults

    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(
        "{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    argv = ["serve", str(model_path), "--temp", "0", "-n", "3", "--seed", "11", "--no-slots", "--props"]
    argv += ["--chat-template-kwargs", '{"greeting": "Ahoy"}']
    args = build_parser(argv).parse_args(argv)
    served = served_from_runtime(load_runtime(model_path), ctx=512, chat_template_file=template)
    served.defaults, served.default_n_predict = request_defaults(args)
    served.template_kwargs = args.chat_template_kwargs
    settings = {"slots_endpoint": args.slots, "props_endpoint": args.props}
    with keyed_server(served, "k1, k2", max_batch=1, **settings) as thread:
        yield thread
    served.close()


def test_a_template_that_renders_a_chat_to_nothing_is_a_400(model_path, tmp_path):
    """`--chat-template-file` of a template that writes only the messages' text: an empty message
    rendered an empty prompt, and the request failed with a 500 ("the prompt has no tokens")."""
    template = tmp_path / "bare.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    served = served_from_runtime(load_runtime(model_path), ctx=512, chat_template_file=template)
    try:
        with keyed_server(served, KEY, max_batch=1) as thread:
            empty = post(thread, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]})
            said = post(thread, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    finally:
        served.close()
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    assert empty.json()["error"]["message"] == "messages: the chat template renders them to no tokens"
    assert said.status_code == 200


def test_serve_flags_set_what_requests_leave_out_as_llama_servers_do(flagged, server):
    """`--temp`, `-n`, `--seed` and `--chat-template-kwargs` are what a request without those fields gets
    (shown in `/props`), a request's own fields still win; `--chat-template-file` renders the chats;
    `--no-slots` and `--props` switch those endpoints; `--api-key k1,k2` takes either key."""
    keys = [{"Authorization": f"Bearer {key}"} for key in ("k1", "k2")]
    params = httpx.get(flagged.url + "/props", headers=keys[1], timeout=10).json()
    settings = params["default_generation_settings"]["params"]
    assert (settings["temperature"], settings["n_predict"], settings["seed"]) == (0.0, 3, 11)
    assert params["endpoint_slots"] is False and params["endpoint_props"] is True
    plain = post(flagged, "/completion", {"prompt": "Once upon"}, headers=keys[0]).json()
    greedy = {"prompt": "Once upon", "n_predict": 3, "temperature": 0}
    assert (
        plain["tokens_predicted"] == 3
        and plain["content"] == post(server, "/completion", greedy).json()["content"]
    )
    assert plain["generation_settings"]["seed"] == 11
    own = post(flagged, "/completion", {"prompt": "Once upon", "n_predict": 5}, headers=keys[0]).json()
    assert own["tokens_predicted"] == 5
    chat = post(flagged, "/v1/chat/completions", {"messages": MESSAGES}, headers=keys[1]).json()
    assert chat["usage"]["completion_tokens"] <= 3
    prompt = post(flagged, "/apply-template", {"messages": MESSAGES}, headers=keys[0]).json()["prompt"]
    assert prompt == "Ahoy<system>Be brief.<user>Hello <b>there</b><assistant>"
    ids = post(flagged, "/tokenize", {"content": prompt}, headers=keys[0]).json()["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(ids)  # the chat request's prompt is that text
    own = {"messages": MESSAGES, "chat_template_kwargs": {"greeting": "Hi"}}
    assert post(flagged, "/apply-template", own, headers=keys[0]).json()["prompt"].startswith("Hi<system>")
    slots = httpx.get(flagged.url + "/slots", headers=keys[0], timeout=10)
    assert slots.status_code == 501 and "Start it with `--slots`" in slots.json()["error"]["message"]
    assert post(flagged, "/props", {}, headers=keys[1]).json() == {"success": True}
    assert post(flagged, "/props", {}, headers={"Authorization": "Bearer k1,k2"}).status_code == 401


def test_cors_headers_go_to_the_origins_named_and_nowhere_else(served, server):
    """`--cors-origins` (llama-server's flag) lets the named origins' pages call: preflights are answered
    without the key (browsers send none), answers and refusals carry the origin; another origin gets
    no CORS header, and a server without the flag sends none."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with keyed_server(served, KEY, max_batch=1, cors_origins=("http://app.example", "localhost")) as cors:
        for origin in ("http://app.example", "http://localhost:5173", "http://127.0.0.1:3000"):
            asked = httpx.options(cors.url + "/v1/chat/completions", headers={"Origin": origin, **preflight})
            assert asked.status_code == 200 and asked.headers["access-control-allow-origin"] == origin
            assert "authorization" in asked.headers["access-control-allow-headers"].lower()
            answer = post(cors, "/tokenize", {"content": "hi"}, headers={**AUTH, "Origin": origin})
            assert answer.headers["access-control-allow-origin"] == origin
            assert answer.headers["access-control-allow-credentials"] == "true"
            refused = post(cors, "/tokenize", {"content": "hi"}, headers={"Origin": origin})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
        foreign = {"Origin": "http://evil.example"}
        asked = httpx.options(cors.url + "/v1/chat/completions", headers={**foreign, **preflight})
        assert asked.status_code == 400 and "access-control-allow-origin" not in asked.headers
        answer = post(cors, "/tokenize", {"content": "hi"}, headers={**AUTH, **foreign})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    answer = post(server, "/tokenize", {"content": "hi"}, headers={**AUTH, "Origin": "http://app.example"})
    assert answer.status_code == 200 and not any(h.startswith("access-control") for h in answer.headers)
    asked = httpx.options(
        server.url + "/v1/chat/completions", headers={"Origin": "http://app.example", **preflight}
    )
    assert asked.status_code == 401 and "access-control-allow-origin" not in asked.headers  # no key


def test_lora_adapters_answer_as_llama_server_without_adapters(server):
    """llama-server without `--lora` lists no adapters and takes an empty list; naming an adapter is an
    invalid id (a request's own `lora` likewise, a 400 naming the field)."""
    assert httpx.get(server.url + "/lora-adapters", headers=AUTH, timeout=10).json() == []
    assert post(server, "/lora-adapters", []).json() == {"success": True}
    for body, words in (([{"id": 0, "scale": 0.5}], "invalid adapter id"), ({"id": 0}, "must be an array")):
        refused = post(server, "/lora-adapters", body)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]
        assert (
            refused.json()["error"]["type"] == "invalid_request_error"
            and "param" not in refused.json()["error"]
        )
    asked = post(server, "/completion", {"prompt": "hi", "n_predict": 1, "lora": [{"id": 0, "scale": 1}]})
    assert asked.status_code == 400 and "lora" in asked.json()["error"]["message"]
    assert post(server, "/completion", {"prompt": "hi", "n_predict": 1, "lora": []}).status_code == 200
