"""What a user of llama-server, vLLM or OpenAI's clients scripts against `k3stream serve`, against a live
server on 127.0.0.1 on a tiny Kimi-K3 GGUF: null fields, error shapes and messages, slot probes, vLLM's
request fields, llama-server's mixed `/tokenize` content, streamed usage and choices, logprobs' shapes,
seeds, token limits and a client that leaves mid-stream, with the real `openai` client and raw HTTP.
The same server's answers without the field in question are the oracle for what a field's default
means (a stop string's place in the unstopped answer, the prompt cut by hand, whole against streamed),
with `/detokenize` and llama.cpp on the same file.
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
from live_server import slow_decode_steps, sse_events
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
    slow_decode_steps(monkeypatch)


def _finish_order(server, bodies: list[dict], wait_for_running: list[int]) -> list[int]:
    """Post each of `bodies` to /completion on its own thread, the i-th once /health shows
    `wait_for_running[i]` sequences running; the indices of the bodies in the order their answers came."""
    order: list[int] = []

    def send(index: int) -> None:
        assert post(server, "/completion", bodies[index]).status_code == 200
        order.append(index)

    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(bodies))]
    _wait_health(server, lambda health: health["running"] == health["waiting"] == 0, "an idle server")
    try:
        for thread, running in zip(threads, wait_for_running, strict=True):
            _wait_health(server, lambda health, n=running: health["running"] >= n, f"{running} running")
            thread.start()
    finally:
        for thread in threads:
            thread.join(60)
    return order


def _wait_health(server, done, what: str) -> None:
    """Read /health until `done` holds of it (20 s at most: a bound, not a timing assertion)."""
    deadline = time.monotonic() + 20
    while not done(httpx.get(server.url + "/health").json()):
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)


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


OPENAI_GREEDY = {"model": "m", "prompt": PROMPT, "temperature": 0, "max_tokens": 16}


def ask(make, **fields):
    """`make` (an openai client's `create`) with `fields`, generating to `max_tokens` (vLLM's
    `ignore_eos`: an answer of a fixed length)."""
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    return make(**fields, extra_body=extra)


def text_of(client, stream: bool = False, **fields) -> tuple[str, str]:
    """A completion's text and finish reason, whole or from its streamed chunks."""
    if not stream:
        choice = ask(client.completions.create, **{**OPENAI_GREEDY, **fields}).choices[0]
        return choice.text, choice.finish_reason
    chunks = [c for c in ask(client.completions.create, **OPENAI_GREEDY, **fields, stream=True) if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_ends_the_answer_with_its_stop_string(client, stream):
    """vLLM's `include_stop_str_in_output`: the answer ends with the stop string that ended it, where
    without the field it ends before it; the stop string is cut from the unstopped answer across
    token boundaries."""
    whole, _ = text_of(client)
    stop = whole[3:9]
    before = whole[: whole.index(stop)]
    assert text_of(client, stream, stop=[stop]) == (before, "stop")
    included = text_of(client, stream, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert included == (before + stop, "stop")


def test_skip_special_tokens_false_writes_special_tokens_as_their_text(client, server, served):
    """vLLM's `skip_special_tokens: false`: a special token generated (forced here by `logit_bias`) is
    written as its text, as `/detokenize` writes it; by default it is left out.
    `spaces_between_special_tokens` changes nothing (a GGUF tokenizer writes each token as it is)."""
    end_ids = served.tokenizer.end_ids
    special = next(i for i in sorted(served.tokenizer.special_tokens.values()) if i not in end_ids)
    forced = {"max_tokens": 3, "logit_bias": {str(special): 100}}
    assert text_of(client, **forced)[0] == ""
    written = post(server, "/detokenize", {"tokens": [special] * 3}).json()["content"]
    assert written
    for spaces in (True, False):
        extra = {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        assert text_of(client, **forced, extra_body=extra)[0] == written


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, served):
    """vLLM's `truncate_prompt_tokens`: the prompt's last N tokens are the prompt (-1: the context's
    worth); 0 or more than the context is a 400 naming the field."""
    ids = served.encode_prompt("A longer prompt of a good many words to cut from the left")
    cut = ask(
        client.completions.create,
        **{**OPENAI_GREEDY, "prompt": ids},
        extra_body={"truncate_prompt_tokens": 5},
    )
    by_hand = ask(client.completions.create, **{**OPENAI_GREEDY, "prompt": ids[-5:]})
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == by_hand.choices[0].text
    whole = ask(
        client.completions.create,
        **{**OPENAI_GREEDY, "prompt": ids},
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert whole.usage.prompt_tokens == len(ids)
    for bad in (0, served.ctx + 1):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client.completions.create, **OPENAI_GREEDY, extra_body={"truncate_prompt_tokens": bad})
        assert caught.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, endpoint):
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries its
    choice's usage so far, growing to the counts of the final usage chunk; without it, only that one."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        fields = {k: v for k, v in OPENAI_GREEDY.items() if k != "prompt"}
        make = client.chat.completions.create
        fields["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        make, fields = client.completions.create, dict(OPENAI_GREEDY)
    chunks = list(ask(make, **fields, stream=True, stream_options=options))
    *answer, final = chunks
    assert not final.choices and final.usage.completion_tokens == OPENAI_GREEDY["max_tokens"]
    counts = [chunk.usage.completion_tokens for chunk in answer]
    assert counts == sorted(counts) and counts[-1] == final.usage.completion_tokens
    assert {chunk.usage.prompt_tokens for chunk in answer} == {final.usage.prompt_tokens}
    plain = list(ask(make, **fields, stream=True, stream_options={"include_usage": True}))
    assert [chunk.usage is not None for chunk in plain] == [False] * (len(plain) - 1) + [True]


@requires_llama
def test_tokenize_takes_llama_servers_mixed_content_of_texts_and_token_ids(server, model_path):
    """llama-server's `/tokenize` `content` may be a list of texts and token ids: each text tokenized as
    llama.cpp tokenizes it, the ids as they are, the BOS token (`add_special`) only before a first text;
    `with_pieces` gives each token's piece. An id outside the vocabulary is a 400 naming it."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)

    def llama(text: str, bos: bool = False) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=bos, special=True)

    content = ["Hello <|im_end|>", 7, " world", 3]
    expected = llama(content[0]) + [7] + llama(content[2]) + [3]
    assert post(server, "/tokenize", {"content": content}).json()["tokens"] == expected
    with_bos = post(server, "/tokenize", {"content": content, "add_special": True}).json()["tokens"]
    assert with_bos == llama(content[0], bos=True) + expected[len(llama(content[0])) :]
    first_id = post(server, "/tokenize", {"content": [7, "Hello"], "add_special": True}).json()["tokens"]
    assert first_id == [7] + llama("Hello")
    pieces = post(server, "/tokenize", {"content": content, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == expected
    detokenized = post(server, "/detokenize", {"tokens": [7]}).json()["content"]
    assert pieces[len(llama(content[0]))]["piece"] in (detokenized, list(detokenized.encode()))
    refused = post(server, "/tokenize", {"content": ["a", vocab.n_vocab()]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "content.1"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_choices_and_usage_are_the_whole_answers(client, endpoint):
    """`n` seeded choices streamed: each choice's chunks (by `index`) make its whole answer's text and
    finish reason; the usage chunk comes last, with no choices, counting the prompt once."""
    fields = {"model": "m", "max_tokens": 6, "n": 2, "seed": 11, "temperature": 1.0}
    if endpoint == "chat":
        make, fields["messages"] = client.chat.completions.create, [{"role": "user", "content": PROMPT}]

        def text(choice) -> str:
            return (choice.message if hasattr(choice, "message") else choice.delta).content or ""
    else:
        make, fields["prompt"] = client.completions.create, PROMPT

        def text(choice) -> str:
            return choice.text

    whole = ask(make, **fields)
    *chunks, usage = ask(make, **fields, stream=True, stream_options={"include_usage": True})
    streamed = {0: "", 1: ""}
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += text(choice)
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert streamed == {choice.index: text(choice) for choice in whole.choices}
    assert reasons == {choice.index: choice.finish_reason for choice in whole.choices}
    assert not usage.choices and usage.usage.model_dump() == whole.usage.model_dump()
    assert usage.usage.completion_tokens == 2 * fields["max_tokens"]


def test_logprobs_have_openais_shapes_streamed_and_whole(client):
    """`/v1/completions`' `logprobs` (tokens, token_logprobs, top_logprobs as token -> logprob maps,
    text_offset) and chat's `logprobs.content` (token, logprob, bytes, top_logprobs), one entry per
    token, streamed as whole."""
    fields = {**OPENAI_GREEDY, "max_tokens": 5, "logprobs": 2}
    whole = ask(client.completions.create, **fields).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 5
    assert all(len(top) <= 2 and all(value <= 0 for value in top.values()) for top in whole.top_logprobs)
    assert whole.text_offset == sorted(whole.text_offset)
    streamed = [
        c.choices[0].logprobs for c in ask(client.completions.create, **fields, stream=True) if c.choices
    ]
    assert [t for part in streamed if part for t in part.token_logprobs] == whole.token_logprobs
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
    answer = ask(client.chat.completions.create, **chat, temperature=0, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_token_limits_and_seeds_as_clients_script_them(client, server):
    """`max_tokens` 1 is one token (`length`); 0 is a 400 on `/v1` (as vLLM's and OpenAI's) and the
    prompt alone on `/completion` (llama-server's); a seed draws the same answer again, on both."""
    one = ask(client.completions.create, **{**OPENAI_GREEDY, "max_tokens": 1})
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{**OPENAI_GREEDY, "max_tokens": 0})
    assert caught.value.body["param"] == "max_tokens"
    native = post(server, "/completion", {"prompt": PROMPT, "n_predict": 0}).json()
    assert native["content"] == "" and native["tokens_predicted"] == 0
    seeded = {**OPENAI_GREEDY, "temperature": 1.5, "seed": 5}
    assert len({ask(client.completions.create, **seeded).choices[0].text for _ in range(2)}) == 1
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 1.5, "seed": 5}
    assert len({post(server, "/completion", body).json()["content"] for _ in range(2)}) == 1


def _predicted(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(
        next(
            line for line in text.splitlines() if line.startswith("llamacpp:tokens_predicted_total ")
        ).split()[1]
    )


def test_a_client_that_leaves_mid_stream_frees_its_slot(client, server, monkeypatch):
    """Both slots stream long answers (10 ms a token at least); their clients leave after a few chunks
    (one the openai client's `close`, one a raw HTTP stream closed): the next request runs, and the
    server generated far fewer tokens than the left answers asked for: their slots were freed."""
    slow_decode_steps(monkeypatch)
    before = _predicted(server)
    long = {**OPENAI_GREEDY, "max_tokens": 200}
    stream = ask(client.completions.create, **long, stream=True)
    for _, _ in zip(stream, range(3), strict=False):
        pass
    body = {**long, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as raw:
        lines = raw.iter_lines()
        for _ in range(3):
            next(lines)
    stream.close()
    after = ask(client.completions.create, **{**OPENAI_GREEDY, "max_tokens": 2})
    assert after.usage.completion_tokens == 2
    assert _predicted(server) - before < 200  # neither left answer ran to its end
    for _ in range(1000):  # the finished sequence is dropped at the scheduler's next step
        health = httpx.get(server.url + "/health", timeout=10).json()
        if health["running"] == 0:
            break
        time.sleep(0.005)
    assert health["running"] == 0 and health["cancelled_jobs"] >= 2
