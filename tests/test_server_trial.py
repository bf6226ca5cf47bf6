"""What a user of llama-server, vLLM or OpenAI's clients scripts against `k3stream serve`, against a live
server on 127.0.0.1 on a tiny Kimi-K3 GGUF: null fields, error shapes and messages, slot probes. The same
server's answers without the field in question are the oracle for what a field's default means.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from k3stream.engine.loading import load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.errors import redact_paths
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime
from k3stream.server.scheduler import Scheduler

PROMPT = "Once upon a time"
GREEDY = {"prompt": PROMPT, "temperature": 0, "n_predict": 6, "ignore_eos": True}
MAX_BATCH = 2
MAX_BODY = 4096

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(model_path):
    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=256)
    yield served
    served.close()


@pytest.fixture(scope="module")
def server(served):
    config = ServerConfig(max_batch=MAX_BATCH, guard=GuardConfig(max_body_bytes=MAX_BODY))
    with ServerThread(create_app(served, config)) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


NATIVE_NULLS = [
    "n_probs",
    "post_sampling_probs",
    "return_tokens",
    "repeat_penalty",
    "repeat_last_n",
    "special",
    "n_keep",
    "n_discard",
    "id_slot",
]


@pytest.mark.parametrize("field", NATIVE_NULLS)
def test_null_is_the_default_of_completions_native_fields_as_in_llama_server(server, field):
    """llama-server reads every field with its default where the value is null (its `json_value`)."""
    answer = post(server, "/completion", {**GREEDY, field: None})
    assert answer.status_code == 200, answer.text
    plain = post(server, "/completion", GREEDY).json()
    assert answer.json()["content"] == plain["content"]
    assert answer.json()["generation_settings"] == plain["generation_settings"]


@pytest.mark.parametrize("field", ["id_slot", "top_logprobs", "tools", "response_format"])
def test_null_chat_and_slot_fields_ask_nothing_of_v1_completions(client, field):
    fields = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    answer = client.completions.create(**fields, extra_body={field: None})
    assert answer.choices[0].text == client.completions.create(**fields).choices[0].text


def test_a_refusal_names_the_endpoint_to_use_whole(client):
    """Error bodies shorten file paths to their names; an endpoint the message points to is no file."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt=PROMPT, extra_body={"tools": []})
    assert "only supported by /v1/chat/completions" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input=PROMPT, top_logprobs=2)
    assert "served by /v1/chat/completions only" in caught.value.body["message"]
    redacted = redact_paths("cannot read /srv/models/k3.gguf; see /api/tags")
    assert redacted == "cannot read k3.gguf; see /api/tags"


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/completion", b'{"prompt": "' + b"a" * MAX_BODY + b'"}', 413),
        ("POST", "/completions", b'{"prompt": "' + b"a" * MAX_BODY + b'"}', 413),
        ("GET", "/completion", b"", 405),
        ("POST", "/slots/0?action=save", b"x" * (MAX_BODY + 1), 413),
    ],
    ids=["completion-413", "completions-413", "completion-405", "slot-action-413"],
)
def test_native_paths_refuse_in_llama_servers_shape_whatever_refuses(server, method, path, content, status):
    """A body too large (refused before any endpoint reads it) or a wrong method on llama-server's native
    paths is its error object: the status as `code`, the type by status, no OpenAI `param`."""
    answer = httpx.request(method, server.url + path, content=content, timeout=60)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["code"] == status and "param" not in error and error["message"]


def test_fail_on_no_slot_answers_503_while_the_batch_is_full_under_one_id_slot(server, monkeypatch):
    """Two requests naming the same `id_slot` run side by side; the batch is then full, and a probe asking
    for a free slot is told so, as llama-server's is while every slot runs."""
    emit = Scheduler._emit_token

    def slow(self, job, logits):  # a decode step long enough to look at the running batch
        time.sleep(0.01)
        return emit(self, job, logits)

    monkeypatch.setattr(Scheduler, "_emit_token", slow)
    body = {**GREEDY, "n_predict": 200, "id_slot": 0}
    threads = [threading.Thread(target=post, args=(server, "/completion", body)) for _ in range(MAX_BATCH)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/health").json()["running"] < MAX_BATCH:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        probe = httpx.get(server.url + "/slots", params={"fail_on_no_slot": 1})
        assert probe.status_code == 503
        assert probe.json()["error"]["message"] == "no slot available"
    finally:
        for thread in threads:
            thread.join(60)
    assert httpx.get(server.url + "/slots", params={"fail_on_no_slot": 1}).status_code == 200
