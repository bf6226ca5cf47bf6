"""What a user of llama-server, vLLM or OpenAI's clients scripts against `k3stream serve`, against a live
server on 127.0.0.1 on a tiny Kimi-K3 GGUF: null fields, error shapes and messages, slot probes. The same
server's answers without the field in question are the oracle for what a field's default means.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from conftest import requires_llama
from k3stream.engine.loading import load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.errors import redact_paths
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime
from k3stream.server.scheduler import Scheduler
from live_server import sse_events
from llama_logits import llama_logits

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


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {"content": "Hello <|im_end|>"}, "add_special"),
        ("/tokenize", {"content": "Hello <|im_end|>"}, "parse_special"),
        ("/tokenize", {"content": "Hello <|im_end|>"}, "with_pieces"),
        ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}, "add_generation_prompt"),
    ],
)
def test_null_is_the_default_of_llama_servers_tokenize_and_template_switches(server, path, body, field):
    answer = post(server, path, {**body, field: None})
    assert answer.status_code == 200, answer.text
    assert answer.json() == post(server, path, body).json()


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


@pytest.fixture
def slow_steps(monkeypatch):
    """Decode steps long enough to look at the running batch between them."""
    emit = Scheduler._emit_token

    def slow(self, job, logits):
        time.sleep(0.01)
        return emit(self, job, logits)

    monkeypatch.setattr(Scheduler, "_emit_token", slow)


def _finish_order(server, bodies: list[dict], wait_for_running: list[int]) -> list[int]:
    """Post each of `bodies` to /completion on its own thread, the i-th once /health shows
    `wait_for_running[i]` sequences running; the indices of the bodies in the order their answers came."""
    order: list[int] = []

    def send(index: int) -> None:
        assert post(server, "/completion", bodies[index]).status_code == 200
        order.append(index)

    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(bodies))]
    try:
        for thread, running in zip(threads, wait_for_running, strict=True):
            deadline = time.monotonic() + 20
            while httpx.get(server.url + "/health").json()["running"] < running:
                assert time.monotonic() < deadline, f"never {running} running"
                time.sleep(0.005)
            thread.start()
    finally:
        for thread in threads:
            thread.join(60)
    return order


def test_a_request_for_a_busy_slot_waits_for_it_while_others_go_first(server, slow_steps):
    """As llama-server defers a task whose `id_slot` is busy: the second request naming slot 0 waits
    until the first ends, and a request for any slot that comes after it runs meanwhile (in the other
    slot), then the batch is full and a probe asking for a free slot is told so."""
    first = {**GREEDY, "n_predict": 150, "id_slot": 0}
    same_slot = {**GREEDY, "n_predict": 2, "id_slot": 0}
    any_slot = {**GREEDY, "n_predict": 60}
    probe: list[httpx.Response] = []

    def while_full() -> None:  # the two slots run, the busy slot's request waits
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health").json()
            if (health["running"], health["waiting"]) == (MAX_BATCH, 1):
                probe.append(httpx.get(server.url + "/slots", params={"fail_on_no_slot": 1}))
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=while_full)
    watcher.start()
    order = _finish_order(server, [first, same_slot, any_slot], [0, 1, 1])
    watcher.join(30)
    assert order == [2, 0, 1]
    assert probe[0].status_code == 503 and probe[0].json()["error"]["message"] == "no slot available"
    assert httpx.get(server.url + "/slots", params={"fail_on_no_slot": 1}).status_code == 200


CITY = {
    "type": "object",
    # bounded values: an answer of any model ends within the tests' token limits
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"enum": [1, 2, 30]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _follows_city(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), CITY)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_each_choice_of_a_constrained_completion_follows_its_own_grammar(server, client):
    """`n_cmpl` (`n`) choices of one prompt under `json_schema`: each choice's grammar state follows its
    own tokens. One state shared by the choices took every choice's tokens, and each answer held only
    part of the object (`{c":Lma}` beside `"ity"i"`)."""
    body = {"prompt": PROMPT, "n_predict": 40, "json_schema": CITY, "n_cmpl": MAX_BATCH, "seed": 3}
    answers = post(server, "/completion", body).json()
    assert len(answers) == MAX_BATCH
    assert all(_follows_city(answer["content"]) for answer in answers), answers
    fields = {"model": "m", "prompt": [PROMPT, "Hello"], "max_tokens": 40, "n": MAX_BATCH, "seed": 3}
    whole = client.completions.create(**fields, extra_body={"guided_json": CITY})
    assert all(_follows_city(choice.text) for choice in whole.choices), whole.choices


def _streamed_texts(client, **fields) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


STRUCTURED = [
    ({"guided_choice": ["yes", 'no "way"', "é🎉\n"]}, lambda text: text in ("yes", 'no "way"', "é🎉\n")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}/x"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}/x", text)),
    ({"structured_outputs": {"regex": "(ab){1,3}c"}}, lambda text: re.fullmatch("(ab){1,3}c", text)),
    ({"guided_json": CITY}, _follows_city),
    ({"guided_json": json.dumps(CITY)}, _follows_city),
    ({"structured_outputs": {"json": CITY}}, _follows_city),
    ({"guided_grammar": 'root ::= "k3" [ab] [ab]'}, lambda text: re.fullmatch("k3[ab]{2}", text)),
    # llama-server's, taken by its OpenAI endpoints as by /completion
    ({"grammar": 'root ::= "k3" [ab] [ab]'}, lambda text: re.fullmatch("k3[ab]{2}", text)),
    ({"json_schema": CITY}, _follows_city),
]


@pytest.mark.parametrize(("fields", "follows"), STRUCTURED, ids=[json.dumps(f)[:40] for f, _ in STRUCTURED])
def test_vllms_structured_outputs_hold_every_endpoints_answer(client, server, fields, follows):
    """vLLM's structured outputs (`structured_outputs` and the `guided_*` fields, as its users send them
    through the openai client's `extra_body`) hold the answer of `/v1/completions` (streamed as whole,
    each choice of each prompt), `/v1/chat/completions` and `/completion`."""
    asked = {"model": "m", "max_tokens": 60, "seed": 5, "extra_body": fields}
    whole = client.completions.create(prompt=[PROMPT, "Hello"], n=MAX_BATCH, **asked)
    texts = {choice.index: choice.text for choice in whole.choices}
    assert len(texts) == 2 * MAX_BATCH and all(follows(text) for text in texts.values()), texts
    assert all(choice.finish_reason == "stop" for choice in whole.choices)
    assert _streamed_texts(client, prompt=[PROMPT, "Hello"], n=MAX_BATCH, **asked) == texts
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **asked)
    assert follows(chat.choices[0].message.content), chat.choices[0].message.content
    native = post(server, "/completion", {"prompt": PROMPT, "n_predict": 60, "seed": 5, **fields}).json()
    assert follows(native["content"]) and native["stop_type"] == "eos", native["content"]


STRUCTURED_REFUSALS = [
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_json": "{"}, "guided_json"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize(
    ("fields", "param"), STRUCTURED_REFUSALS, ids=[json.dumps(f)[:40] for f, _ in STRUCTURED_REFUSALS]
)
def test_a_structured_output_that_cannot_be_followed_is_a_400_naming_its_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=4, extra_body=fields)
    assert caught.value.body["param"] == param


def test_a_structured_output_beside_another_grammar_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"guided_choice": ["a"]},
        )
    assert caught.value.body["param"] == "guided_choice"
    both = post(server, "/completion", {"prompt": PROMPT, "grammar": 'root ::= "a"', "guided_regex": "b"})
    assert both.status_code == 400 and "guided_regex" in both.json()["error"]["message"]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row.astype(np.float64) - row.max()
    return shifted - np.log(np.exp(shifted).sum())


@requires_llama
def test_sampled_tokens_logprobs_are_llama_cpps_log_probabilities_streamed_or_whole(
    server, served, model_path, tmp_path
):
    """The logprobs of a seeded, sampled answer (`/completion`'s `n_probs`, `/v1/completions`'
    `logprobs`, streamed and whole) are the log-softmax of llama.cpp's logits at each position of the
    prompt and the answer so far: the model's own log-probabilities, alternatives included."""
    prompt_ids = served.tokenizer.encode(PROMPT)
    body = {"prompt": prompt_ids, "n_predict": 10, "n_probs": 3, "seed": 8, "temperature": 1.2}
    whole = post(server, "/completion", body).json()["completion_probabilities"]
    streamed = post(server, "/completion", {**body, "stream": True}).text
    assert [p for event in sse_events(streamed) for p in event.get("completion_probabilities", [])] == whole
    fields = {
        "model": "m",
        "prompt": prompt_ids,
        "max_tokens": 10,
        "logprobs": 3,
        "seed": 8,
        "temperature": 1.2,
    }
    openai_whole = post(server, "/v1/completions", fields).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert openai_whole == [entry["logprob"] for entry in whole]
    ids = [entry["id"] for entry in whole]
    (logits,) = llama_logits([(model_path, prompt_ids + ids)], tmp_path)
    for step, entry in enumerate(whole):
        expected = _log_softmax(logits[len(prompt_ids) - 1 + step])
        assert entry["logprob"] == pytest.approx(expected[entry["id"]], abs=1e-4)
        third = np.sort(expected)[-3]  # the alternatives are the three likeliest (ties within rounding)
        assert len(entry["top_logprobs"]) == 3
        for alternative in entry["top_logprobs"]:
            assert alternative["logprob"] == pytest.approx(expected[alternative["id"]], abs=1e-4)
            assert expected[alternative["id"]] >= third - 1e-4


def test_text_offsets_count_characters_where_tokens_split_them(server):
    """`/v1/completions`' `text_offset` is where each token starts in the text, in characters: the
    tokens holding the bytes of one character (an emoji is four) start within it, and the text after it
    starts one character later, streamed or whole (a token of one byte had counted as a character)."""
    guided = {"prompt": PROMPT, "seed": 2, "guided_choice": ["a🎉x🦀"]}
    asked = {**guided, "max_tokens": 30, "logprobs": 1}
    whole = post(server, "/v1/completions", asked).json()["choices"][0]
    native = post(server, "/completion", {**guided, "n_predict": 30, "n_probs": 1}).json()
    token_bytes = [bytes(entry["bytes"]) for entry in native["completion_probabilities"]]
    assert len(token_bytes) == len(whole["logprobs"]["tokens"])
    expected = [len(b"".join(token_bytes[:i]).decode("utf-8", "ignore")) for i in range(len(token_bytes))]
    assert whole["logprobs"]["text_offset"] == expected
    assert expected[-1] == len(whole["text"])  # the end of the turn comes after the whole text
    streamed = post(server, "/v1/completions", {**asked, "stream": True}).text.replace("data: [DONE]", "")
    chunks = [choice["logprobs"] for event in sse_events(streamed) for choice in event["choices"]]
    assert [offset for chunk in chunks if chunk for offset in chunk["text_offset"]] == expected


NOT_SERVED = [
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/completion", {"grammar": 'root ::= "a"', "grammar_lazy": True}, "grammar_lazy"),
    ("/completion", {"grammar_triggers": [{"type": 0, "value": "{"}]}, "grammar_triggers"),
]


@pytest.mark.parametrize(("path", "fields", "field"), NOT_SERVED, ids=[case[2] for case in NOT_SERVED])
def test_fields_vllm_or_llama_server_act_on_are_refused_not_ignored(server, path, fields, field):
    """vLLM renders a request's own `chat_template` and echoes the last message on chat; llama-server
    holds a lazy grammar back until a trigger: a request asking for them is refused by name, never
    answered as if they had been honoured."""
    body = {"prompt": PROMPT, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **fields}
    answer = post(server, path, body)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith(field)


def test_llama_servers_empty_json_schema_is_any_json_object_on_its_openai_endpoints(client):
    asked = {"model": "m", "max_tokens": 3, "seed": 1, "extra_body": {"json_schema": {}}}
    answer = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **asked)
    assert answer.choices[0].message.content.startswith("{")
    assert client.completions.create(prompt=PROMPT, **asked).choices[0].text.startswith("{")


def test_response_format_holds_a_completions_text_as_vllm_serves_it(client):
    """vLLM takes `response_format` on `/v1/completions` too: the text follows the format's schema, each
    choice of each prompt, streamed as whole; a format without its schema is a 400 naming it."""
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    asked = {
        "model": "m",
        "max_tokens": 60,
        "seed": 4,
        "n": MAX_BATCH,
        "extra_body": {"response_format": response_format},
    }
    whole = client.completions.create(prompt=[PROMPT, "Hello"], **asked)
    texts = {choice.index: choice.text for choice in whole.choices}
    assert len(texts) == 2 * MAX_BATCH and all(_follows_city(text) for text in texts.values()), texts
    assert _streamed_texts(client, prompt=[PROMPT, "Hello"], **asked) == texts
    plain = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=3, extra_body={"response_format": {"type": "json_object"}}
    )
    assert plain.choices[0].text.startswith("{")
    for fields, param in [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="m", prompt=PROMPT, max_tokens=3, extra_body=fields)
        assert caught.value.body["param"] == param


def _draws(server, path: str, key: str, **fields) -> list[str]:
    """The texts of three seeded draws of `fields` from `path` (`key` the text's field of its answer)."""
    texts = []
    for seed in (1, 2, 3):
        reply = post(
            server, path, {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": seed, **fields}
        )
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        texts.append(answer["choices"][0]["text"] if key == "choices" else answer[key])
    return texts


def test_a_temperature_above_2_is_served_on_every_endpoint_as_llama_server_and_vllm_serve_it(server):
    """OpenAI's API stops temperature at 2; llama-server and vLLM take any from 0 up, and a script sent to
    a local server means it: a hot draw differs from a cool one of the same seed, and /v1/completions and
    /completion draw alike."""
    hot = _draws(server, "/v1/completions", "choices", temperature=3.5)
    assert hot == _draws(server, "/completion", "content", temperature=3.5)
    assert hot != _draws(server, "/v1/completions", "choices", temperature=0.2)


def test_penalties_keep_openais_range_on_v1_and_any_value_on_llama_servers_completion(server):
    """vLLM and OpenAI refuse presence and frequency penalties outside [-2, 2], llama-server's /completion
    takes any: each endpoint family as its servers do. A temperature of 0 or below on /completion is
    llama-server's greedy choice; on /v1 a negative one is a 400, as vLLM's."""
    for name in ("presence_penalty", "frequency_penalty"):
        refused = post(server, "/v1/completions", {"prompt": PROMPT, name: 2.5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name
        strong = _draws(server, "/completion", "content", temperature=1.0, **{name: -5.0})  # repeats
        assert strong != _draws(server, "/completion", "content", temperature=1.0)
    greedy = _draws(server, "/completion", "content", temperature=0)
    assert _draws(server, "/completion", "content", temperature=-1) == greedy
    refused = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": -0.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
    for path in ("/v1/completions", "/completion"):  # JSON's non-numbers, as Python's json writes them
        content = b'{"prompt": "Hi", "temperature": Infinity}'
        reply = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "temperature" in reply.text
