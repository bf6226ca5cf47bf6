"""llama-server's native API (`/completion`, `/completions`, slot save/restore/erase, and its answers for
infill, embeddings and reranking), against a live server on 127.0.0.1 on a tiny Kimi-K3 GGUF with the
prompt cache on. The OpenAI endpoints of the same server are the oracle for what the native fields mean.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import pytest

from k3stream.engine.loading import load_runtime
from k3stream.engine.prompt_cache import PromptCache
from k3stream.memlimit import MIB
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime
from live_server import slow_decode_steps

KEY = "sk-test-native"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _served(model_path):
    """A server's model with a prompt cache of its own (the fingerprint a model file's: one for all)."""
    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=256)
    served.prompt_cache = PromptCache(served.model, "tiny-native", 64 * MIB, every=16)
    return served


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def served(model_path):
    served = _served(model_path)
    yield served
    served.prompt_cache.close()
    served.close()


@pytest.fixture(scope="module")
def server(served, slot_dir):
    config = ServerConfig(max_batch=2, guard=GuardConfig(api_key=KEY), slot_save_path=slot_dir)
    with ServerThread(create_app(served, config)) as thread:
        yield thread


def post(server, path, body, headers=AUTH):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def complete(server, **body):
    reply = post(server, "/completion", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tokenize(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]


def llama_error(reply, status: int) -> str:
    """The message of a llama-server error body of `status`."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"code", "message", "type"} and error["code"] == status
    return error["message"]


def test_completion_answers_as_v1_completions_in_llama_servers_fields(server, served):
    native = complete(server, prompt=PROMPT, **GREEDY)
    openai = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    )
    assert native["content"] == openai.json()["choices"][0]["text"]
    prompt_ids = tokenize(server, PROMPT)
    assert native["stop"] is True and native["stop_type"] == "limit" and native["stopping_word"] == ""
    assert native["tokens_predicted"] == 12 and native["tokens_evaluated"] == len(prompt_ids)
    assert native["tokens_cached"] == len(prompt_ids) + 11
    assert native["model"] == served.name and native["truncated"] is False
    assert native["has_new_line"] == ("\n" in native["content"])
    assert native["prompt"] == post(server, "/detokenize", {"tokens": prompt_ids}).json()["content"]
    assert native["tokens"] == [] and 0 <= native["id_slot"] < 2 and native["index"] == 0
    assert native["generation_settings"]["temperature"] == 0 and native["generation_settings"]["n_probs"] == 0
    assert set(native["timings"]) >= TIMINGS and native["timings"]["predicted_n"] == 12
    assert post(server, "/completions", {"prompt": PROMPT, **GREEDY}).json()["content"] == native["content"]


def test_prompts_as_token_ids_mixed_and_several(server):
    text = complete(server, prompt=PROMPT, **GREEDY)
    ids = tokenize(server, PROMPT)
    assert complete(server, prompt=ids, **GREEDY)["content"] == text["content"]
    tail = post(server, "/tokenize", {"content": " and then"}).json()["tokens"]
    mixed = complete(server, prompt=[*ids, " and then"], **GREEDY)
    assert mixed["tokens_evaluated"] == len(ids) + len(tail)
    assert mixed["content"] == complete(server, prompt=ids + tail, **GREEDY)["content"]
    several = post(server, "/completion", {"prompt": [PROMPT, ids + tail], **GREEDY}).json()
    assert isinstance(several, list) and [r["index"] for r in several] == [0, 1]
    assert [r["content"] for r in several] == [text["content"], mixed["content"]]


def test_an_empty_prompt_list_is_a_400_naming_the_prompt(server):
    """`"prompt": []` holds no prompt at all: a 400 naming `prompt`, as an empty string is, on both
    completion endpoints (never a 500)."""
    for prompt in ([], "", [[]]):
        assert "prompt" in llama_error(post(server, "/completion", {"prompt": prompt, "n_predict": 2}), 400)
        reply = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("prompt"), reply.text


def test_return_tokens_and_stream_chunks(server):
    whole = complete(server, prompt=PROMPT, return_tokens=True, **GREEDY)
    assert len(whole["tokens"]) == 12
    assert post(server, "/detokenize", {"tokens": whole["tokens"]}).json()["content"] == whole["content"]
    body = {"prompt": PROMPT, "return_tokens": True, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/completion", json=body, headers=AUTH, timeout=120) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines)  # no `[DONE]`: llama-server's native stream
    chunks = [json.loads(line[len("data: ") :]) for line in lines]
    *pieces, last = chunks
    assert not any(c["stop"] for c in pieces) and last["stop"] is True
    assert "".join(c["content"] for c in pieces) == whole["content"] and last["content"] == ""
    assert [t for c in pieces for t in c["tokens"]] == whole["tokens"]
    assert [c["tokens_predicted"] for c in pieces][-1] == 12
    assert last["stop_type"] == "limit" and last["tokens_predicted"] == 12 and set(last["timings"]) >= TIMINGS


def test_stop_types_word_eos_and_limit_to_the_context(server, served):
    text = complete(server, prompt=PROMPT, n_predict=24, temperature=0, ignore_eos=True)["content"]
    word = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = complete(
        server, prompt=PROMPT, n_predict=24, temperature=0, ignore_eos=True, stop=[word, "\x00"]
    )
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == text[: text.index(word)]
    eos = complete(server, prompt=PROMPT, n_predict=8, logit_bias=[[served.tokenizer.eos_id, 100]])
    assert eos["stop_type"] == "eos" and eos["tokens_predicted"] == 1 and eos["content"] == ""
    room = served.ctx - len(tokenize(server, PROMPT))
    for n_predict in (-1, served.ctx + 100):  # past the context: cut there, as llama-server does
        to_context = complete(server, prompt=PROMPT, n_predict=n_predict, ignore_eos=True, temperature=0)
        assert to_context["stop_type"] == "limit" and to_context["tokens_predicted"] == room


def test_n_probs_are_the_models_logprobs_in_llama_servers_format(server):
    native = complete(server, prompt=PROMPT, n_probs=3, **GREEDY)
    openai = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 3},
    ).json()["choices"][0]["logprobs"]
    probs = native["completion_probabilities"]
    assert len(probs) == 12
    assert [p["logprob"] for p in probs] == openai["token_logprobs"]
    for entry in probs:
        assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["id"] == entry["id"]  # greedy
        assert set(entry["top_logprobs"][0]) == {"id", "token", "bytes", "logprob"}
    assert "".join(bytes(p["bytes"]).decode("utf-8", "replace") for p in probs).startswith(
        native["content"][:1]
    )


def test_samplers_left_out_do_nothing_and_unknown_ones_are_refused(server):
    greedy = complete(server, prompt=PROMPT, **GREEDY)["content"]
    hot = {**GREEDY, "temperature": 1.5, "seed": 7, "top_k": 1}
    assert complete(server, prompt=PROMPT, samplers=["top_k", "temperature"], **hot)["content"] == greedy
    no_top_k = complete(server, prompt=PROMPT, samplers="t", **hot)["content"]
    assert no_top_k == complete(server, prompt=PROMPT, **{**hot, "top_k": 0})["content"]
    message = llama_error(post(server, "/completion", {"prompt": PROMPT, "samplers": ["top_k", "beam"]}), 400)
    assert message.startswith("samplers.1: unknown sampler 'beam'")
    assert complete(server, prompt=PROMPT, min_keep=0, **hot)["content"] == greedy  # llama-server's default
    message = llama_error(post(server, "/completion", {"prompt": PROMPT, "min_keep": 2, **hot}), 400)
    assert message == "min_keep is not supported by this server"  # it would keep tokens top-k drops


def test_repeat_penalty_over_the_last_tokens(server):
    body = {"temperature": 0, "ignore_eos": True}
    vllm = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "repetition_penalty": 1.8, **body}
    )
    whole = complete(server, prompt=PROMPT, n_predict=16, repeat_penalty=1.8, repeat_last_n=-1, **body)
    assert whole["content"] == vllm.json()["choices"][0]["text"]
    off = complete(server, prompt=PROMPT, n_predict=16, repeat_penalty=1.8, repeat_last_n=0, **body)
    assert off["content"] == complete(server, prompt=PROMPT, n_predict=16, **body)["content"]
    assert whole["generation_settings"]["repeat_penalty"] == 1.8


def test_presence_and_frequency_penalties_count_the_last_repeat_last_n_tokens_of_the_prompt(server, served):
    """As llama-server's penalties sampler (fed the prompt's tokens, then the output's): the first token
    is the argmax of the logits less `frequency_penalty` times each token's count in the last
    `repeat_last_n` prompt tokens, less `presence_penalty` once for each token there. A prompt is found
    where that differs from OpenAI's count (the output alone: nothing before the first token)."""
    import torch

    from k3stream.engine.generate import prefill_last

    penalties = {"presence_penalty": 2.0, "frequency_penalty": 1.0}
    ids = tokenize(server, PROMPT)
    for _ in range(40):  # the prompt grows by its greedy continuation until a penalty turns the argmax
        logits = prefill_last(served.model, served.model.new_state(), ids).float()
        counts = torch.bincount(torch.tensor(ids[-8:]), minlength=logits.numel()).float()
        penalized = (
            logits - counts * penalties["frequency_penalty"] - (counts > 0) * penalties["presence_penalty"]
        )
        if int(penalized.argmax()) != int(logits.argmax()):
            break
        ids = [*ids, int(logits.argmax())]
    else:
        pytest.fail("no prompt whose penalties change the first token")
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    windowed = complete(server, repeat_last_n=8, **penalties, **body)["tokens"]
    assert windowed == [int(penalized.argmax())]
    assert complete(server, repeat_last_n=0, **penalties, **body)["tokens"] == [int(logits.argmax())]


def test_json_schema_and_gbnf_grammar_constrain_the_answer(server):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    answer = complete(server, prompt=PROMPT, json_schema=schema, n_predict=40, seed=3)
    assert set(json.loads(answer["content"])) == {"a"} and answer["stop_type"] == "eos"
    for seed in range(3):
        picked = complete(server, prompt=PROMPT, grammar='root ::= "yes" | "no"', n_predict=8, seed=seed)
        assert picked["content"] in ("yes", "no") and picked["stop_type"] == "eos"
    # json_schema {} is any JSON object (llama.cpp's json_schema_to_grammar of an empty schema), and
    # with a grammar beside it llama-server's 400, as for any schema
    for seed in range(3):  # an object's first character, whole where the answer ended by itself
        anything = complete(server, prompt=PROMPT, json_schema={}, n_predict=40, seed=seed)
        assert anything["content"].startswith("{"), anything["content"]
        if anything["stop_type"] == "eos":
            assert isinstance(json.loads(anything["content"]), dict)
    both = post(server, "/completion", {"prompt": "x", "json_schema": {}, "grammar": 'root ::= "a"'})
    assert "not both" in llama_error(both, 400)
    # a syntax error, and grammars that parse but name a rule nobody defines or have no root:
    # llama-server's 400 for each (not a 500 "internal error: Exception: ...")
    for grammar, reason in [
        ("root ::= (", "Expected ')'"),
        ("root ::= foo", "Rule 'foo' not found"),
        ('start ::= "a"', "No 'root' rule found"),
    ]:
        message = llama_error(post(server, "/completion", {"prompt": "x", "grammar": grammar}), 400)
        assert message.startswith("grammar: not a GBNF grammar: ") and reason in message, message


def test_cache_prompt_reuses_the_prompt_and_false_computes_it_whole(server):
    prompt = PROMPT + " there was a cache"
    first = complete(server, prompt=prompt, **GREEDY)
    again = complete(server, prompt=prompt, **GREEDY)
    assert again["timings"]["cache_n"] > 0 and again["content"] == first["content"]
    cold = complete(server, prompt=prompt, cache_prompt=False, **GREEDY)
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == cold["tokens_evaluated"]
    assert cold["content"] == first["content"]


def test_n_predict_zero_evaluates_the_prompt_and_keeps_its_state_for_the_next_request(server):
    """llama-server's prompt warm-up: `n_predict: 0` answers empty content after the prefill; the
    prompt's state is snapshotted, so a request extending the prompt restores all of it."""
    ids = tokenize(server, PROMPT + " warmed up ahead of time")
    warm = complete(server, prompt=ids, n_predict=0)
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    assert warm["timings"]["cache_n"] + warm["timings"]["prompt_n"] == len(ids)
    assert warm["tokens_cached"] == len(ids)
    assert warm["generation_settings"]["n_predict"] == 0  # the asked 0, not the 1 it samples with
    tail = post(server, "/tokenize", {"content": " and then", "add_special": False}).json()["tokens"]
    longer = [*ids, *tail]
    reused = complete(server, prompt=longer, **GREEDY)
    assert reused["timings"]["cache_n"] == len(ids)
    assert reused["content"] == complete(server, prompt=longer, cache_prompt=False, **GREEDY)["content"]


def test_id_slot_and_errors_in_llama_servers_shape(server):
    assert complete(server, prompt=PROMPT + " in slot one", id_slot=1, n_predict=2)["id_slot"] == 1
    follow_up = complete(server, prompt=PROMPT + " in slot one, again", n_predict=2)
    assert follow_up["id_slot"] == 1  # the slot whose conversation shares the longest prefix
    assert "id_slot" in llama_error(post(server, "/completion", {"prompt": PROMPT, "id_slot": 2}), 400)
    too_long = post(server, "/completion", {"prompt": list(range(1, 300))}).json()["error"]
    assert too_long["code"] == 400 and too_long["type"] == "exceed_context_size_error"
    assert too_long["n_prompt_tokens"] == 299 and too_long["n_ctx"] == 256
    assert llama_error(post(server, "/completion", {"prompt": ""}), 400).startswith("prompt")
    refused = post(server, "/completion", {"prompt": PROMPT, "n_cmpl": 3})  # the server has 2 slots
    assert llama_error(refused, 400).startswith("n_cmpl cannot be greater than the number of slots")


@pytest.mark.parametrize(
    "path, start",
    [
        ("/infill", "Infill is not supported by this model: prefix token is missing."),
        ("/embedding", "This server does not support embeddings."),
        ("/embeddings", "This server does not support embeddings."),
        ("/v1/embeddings", "This server does not support embeddings."),
        ("/rerank", "This server does not support reranking."),
        ("/v1/rerank", "This server does not support reranking."),
    ],
)
def test_unserved_llama_endpoints_answer_501_as_llama_server(server, path, start):
    reply = post(server, path, {"input": "x", "input_prefix": "a", "input_suffix": "b", "query": "q"})
    assert llama_error(reply, 501).startswith(start)
    assert reply.json()["error"]["type"] == "not_supported_error"


def test_a_saved_slot_restores_into_another_server_and_its_prefix_is_reused(server, slot_dir, model_path):
    turn = complete(server, prompt=PROMPT + " a slot", id_slot=0, return_tokens=True, **GREEDY)
    saved = post(server, "/slots/0?action=save", {"filename": "conv.k3slot"}).json()
    assert saved["id_slot"] == 0 and saved["filename"] == "conv.k3slot"
    assert saved["n_saved"] == turn["tokens_cached"] and "save_ms" in saved["timings"]
    assert sorted(p.name for p in slot_dir.iterdir()) == ["conv.k3slot"]  # no temporary file left
    assert saved["n_written"] == (slot_dir / "conv.k3slot").stat().st_size
    assert post(server, "/slots/0?action=erase", {}).json() == {"id_slot": 0, "n_erased": saved["n_saved"]}
    history = tokenize(server, PROMPT + " a slot") + turn["tokens"]
    cold = complete(server, prompt=history, cache_prompt=False, **GREEDY)
    fresh = _served(model_path)
    config = ServerConfig(max_batch=1, slot_save_path=slot_dir)
    try:
        with ServerThread(create_app(fresh, config)) as other:
            restored = post(other, "/slots/0?action=restore", {"filename": "conv.k3slot"}, headers={}).json()
            assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
            warm = complete(other, prompt=history, **GREEDY)
    finally:
        fresh.prompt_cache.close()
        fresh.close()
    assert warm["timings"]["cache_n"] == saved["n_saved"] and warm["content"] == cold["content"]


def test_a_slot_that_ran_nothing_saves_the_empty_state_and_restoring_it_empties_a_slot(served, slot_dir):
    """llama-server saves a slot that ran no request as a file of 0 tokens (`n_saved` 0); restoring that
    file into a slot that holds a conversation leaves it none."""
    with ServerThread(create_app(served, ServerConfig(max_batch=1, slot_save_path=slot_dir))) as fresh:
        saved = post(fresh, "/slots/0?action=save", {"filename": "empty.k3slot"}, headers={}).json()
        assert saved["n_saved"] == 0 and saved["n_written"] == (slot_dir / "empty.k3slot").stat().st_size
        complete(fresh, prompt=PROMPT, id_slot=0, **GREEDY)
        restored = post(fresh, "/slots/0?action=restore", {"filename": "empty.k3slot"}, headers={}).json()
        assert restored["n_restored"] == 0 and restored["n_read"] == saved["n_written"]
        assert post(fresh, "/slots/0?action=erase", {}, headers={}).json() == {"id_slot": 0, "n_erased": 0}
    (slot_dir / "empty.k3slot").unlink()


@pytest.mark.parametrize(
    "name", ["../escape.k3slot", "a/b", "", ".", "..", " x", "x.", "a\\b", "nul\x00", "x" * 256]
)
def test_slot_filenames_that_are_no_plain_names_are_refused(server, name):
    reply = post(server, "/slots/0?action=save", {"filename": name})
    assert llama_error(reply, 400) == "Invalid filename"


def test_slot_action_errors(server, slot_dir, model_path):
    assert llama_error(post(server, "/slots/0?action=fly", {"filename": "x"}), 400) == "Invalid action"
    assert llama_error(post(server, "/slots/abc?action=save", {"filename": "x"}), 400) == "Invalid slot ID"
    assert llama_error(post(server, "/slots/2?action=save", {"filename": "x"}), 400) == "Invalid slot ID"
    missing = post(server, "/slots/0?action=restore", {"filename": "missing.k3slot"})
    assert llama_error(missing, 400).startswith("Unable to restore slot")
    (slot_dir / "bad.k3slot").write_bytes(b"K3SNAP02" + bytes(40))
    assert llama_error(post(server, "/slots/1?action=restore", {"filename": "bad.k3slot"}), 400).startswith(
        "Unable to restore slot"
    )
    (slot_dir / "bad.k3slot").unlink()
    complete(
        server, prompt=PROMPT, id_slot=0, **GREEDY
    )  # a state to save, over a folder's name: 400, not 500
    (slot_dir / "folder.k3slot").mkdir()
    reply = post(server, "/slots/0?action=save", {"filename": "folder.k3slot"})
    assert llama_error(reply, 400) == "Unable to save slot: folder.k3slot is a folder"
    (slot_dir / "folder.k3slot").rmdir()
    assert post(server, "/slots/0?action=save", {"filename": "x"}, headers={}).status_code == 401
    plain = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=256)  # no prompt cache
    with ServerThread(create_app(plain, ServerConfig(max_batch=1))) as off:
        message = llama_error(post(off, "/slots/0?action=save", {"filename": "x"}), 501)
    plain.close()
    assert message == "This server does not support slots action. Start it with `--slot-save-path`"


def test_n_cmpl_gives_each_prompt_that_many_completions_in_llama_servers_order(server):
    """llama-server's `n_cmpl` (alias `n`): completion j of prompt i is result i * n + j; a seeded
    request's completion j draws with seed + j, as the same request with n 1 and that seed does."""
    ids = tokenize(server, PROMPT + " far away")
    sampled = {"temperature": 1.0, "n_predict": 6, "ignore_eos": True}
    results = post(server, "/completion", {"prompt": [PROMPT, ids], "n_cmpl": 2, "seed": 5, **sampled}).json()
    assert isinstance(results, list) and [r["index"] for r in results] == [0, 1, 2, 3]
    for index, result in enumerate(results):
        prompt, choice = [PROMPT, ids][index // 2], index % 2
        alone = complete(server, prompt=prompt, seed=5 + choice, **sampled)
        assert (
            result["content"] == alone["content"] and result["tokens_evaluated"] == alone["tokens_evaluated"]
        )
        assert result["timings"]["predicted_n"] == result["tokens_predicted"] == 6
        assert result["timings"]["cache_n"] + result["timings"]["prompt_n"] == result["tokens_evaluated"]
    assert [r["id_slot"] for r in results[:2]] in ([0, 1], [1, 0])  # the choices run in slots of their own
    with_n = post(server, "/completion", {"prompt": PROMPT, "n": 2, "seed": 5, **sampled}).json()
    assert [r["content"] for r in with_n] == [r["content"] for r in results[:2]]


def test_post_sampling_probs_are_the_distribution_after_the_sampler_chain(server):
    """Top-k 3 at temperature 0.7: the post-sampling probabilities of a position are the softmax of the
    three likeliest log-probabilities (the same request without post_sampling_probs) over 0.7."""
    sampled = {
        "prompt": PROMPT,
        "n_predict": 8,
        "ignore_eos": True,
        "temperature": 0.7,
        "top_k": 3,
        "seed": 11,
    }
    own = complete(server, n_probs=5, **sampled)["completion_probabilities"]
    post_chain = complete(server, n_probs=5, post_sampling_probs=True, **sampled)["completion_probabilities"]
    assert [p["id"] for p in post_chain] == [p["id"] for p in own]
    for mine, model in zip(post_chain, own, strict=True):
        assert set(mine) == {"id", "token", "bytes", "prob", "top_probs"}
        kept = model["top_logprobs"][:3]
        weights = [math.exp(entry["logprob"] / 0.7) for entry in kept]
        expected = {entry["id"]: w / sum(weights) for entry, w in zip(kept, weights, strict=True)}
        assert [t["id"] for t in mine["top_probs"]] == list(expected)  # zero-probability tokens left out
        for entry in mine["top_probs"]:
            assert set(entry) == {"id", "token", "bytes", "prob"}
            assert entry["prob"] == pytest.approx(expected[entry["id"]], rel=1e-4)
        assert mine["prob"] == pytest.approx(expected[mine["id"]], rel=1e-4)
    greedy = complete(server, prompt=PROMPT, n_probs=3, post_sampling_probs=True, **GREEDY)
    for entry in greedy["completion_probabilities"]:  # a greedy draw keeps its one token
        assert entry["prob"] == 1.0 and [(t["id"], t["prob"]) for t in entry["top_probs"]] == [
            (entry["id"], 1.0)
        ]


def test_response_fields_keep_only_the_listed_fields_and_unnest_paths(server):
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no_such_field", "content/x"]
    whole = complete(server, prompt=PROMPT, response_fields=fields, **GREEDY)
    text = complete(server, prompt=PROMPT, **GREEDY)["content"]
    assert whole == {"content": text, "generation_settings/n_predict": 12, "timings/predicted_n": 12}
    body = {"prompt": PROMPT, "stream": True, "response_fields": ["stop", "tokens_predicted"], **GREEDY}
    with httpx.stream("POST", server.url + "/completion", json=body, headers=AUTH, timeout=120) as reply:
        chunks = [json.loads(line[len("data: ") :]) for line in reply.iter_lines() if line]
    *pieces, last = chunks
    assert last == {"stop": True, "tokens_predicted": 12}  # the final result only, as llama-server
    assert "".join(c["content"] for c in pieces) == text


def test_v1_completions_list_gives_each_prompt_its_own_timings_and_adds_them_up(server):
    prompts = [PROMPT, PROMPT + " and a longer second prompt of the request"]
    body = {
        "prompt": prompts,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    answer = post(server, "/v1/completions", body).json()
    lengths = [len(tokenize(server, prompt)) for prompt in prompts]
    for choice in answer["choices"]:
        timings, length = choice["timings"], lengths[choice["index"] // 2]
        assert (timings["prompt_n"], timings["cache_n"], timings["predicted_n"]) == (length, 0, 5)
    total = answer["timings"]
    assert (total["prompt_n"], total["cache_n"], total["predicted_n"]) == (sum(lengths), 0, 20)
    firsts = [answer["choices"][0]["timings"], answer["choices"][2]["timings"]]
    assert total["prompt_ms"] == pytest.approx(sum(t["prompt_ms"] for t in firsts))
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (sum(lengths), 20)
    assert usage["total_tokens"] == sum(lengths) + 20
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=streamed, headers=AUTH, timeout=120
    ) as reply:
        lines = [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line) for line in lines]
    ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted((e["index"], e["timings"]["prompt_n"]) for e in ends) == [
        (i, lengths[i // 2]) for i in range(4)
    ]
    assert chunks[-1]["usage"] == usage and chunks[-1]["timings"]["prompt_n"] == sum(lengths)


def test_api_key_errors_are_llama_servers_on_its_paths_and_openais_under_v1(server):
    native = post(server, "/completion", {"prompt": PROMPT}, headers={})
    assert llama_error(native, 401) == "Invalid API Key"
    assert native.json()["error"]["type"] == "authentication_error"
    for path in ("/slots", "/props", "/metrics"):
        assert llama_error(httpx.get(server.url + path, timeout=10), 401) == "Invalid API Key"
    openai = post(server, "/v1/completions", {"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"})
    assert openai.status_code == 401
    error = openai.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    for path in ("/", "/health", "/v1/health", "/models", "/v1/models"):  # llama-server's public paths
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path


def test_slots_list_every_slot_with_the_running_request_under_its_id_slot(server):
    """GET /slots numbers its entries by slot, the `id_slot` of /completion and of slot actions."""
    body = {
        "prompt": PROMPT + " in slot one",
        "id_slot": 1,
        "n_predict": 200,
        "ignore_eos": True,
        "stream": True,
    }
    answer: list = []
    runner = threading.Thread(target=lambda: answer.append(_stream_last(server, body)), daemon=True)
    runner.start()
    slots = _poll(server, lambda s: s[1]["is_processing"] and s[1]["next_token"][0]["n_decoded"] > 0)
    assert [s["id"] for s in slots] == [0, 1] and not slots[0]["is_processing"]
    running = slots[1]
    assert running["n_ctx"] == 256 and running["params"]["n_predict"] == 200
    step = running["next_token"][0]
    assert step["has_next_token"] and step["n_remain"] == 200 - step["n_decoded"]
    assert running["n_prompt_tokens"] == len(tokenize(server, PROMPT + " in slot one"))
    has_room = httpx.get(server.url + "/slots?fail_on_no_slot=1", headers=AUTH, timeout=10)
    assert has_room.status_code == 200  # slot 0 is idle
    runner.join(120)
    done = _poll(server, lambda s: not s[1]["is_processing"])[1]
    assert done["id_task"] == running["id_task"] and done["next_token"][0]["has_next_token"] is False
    assert done["next_token"][0]["n_decoded"] == answer[0]["tokens_predicted"] == 200
    saved = post(server, "/slots/1?action=save", {"filename": "slot-one.k3slot"}).json()
    assert saved["n_saved"] == answer[0]["tokens_cached"]
    complete(server, prompt=PROMPT, id_slot=1, n_predict=1)
    assert _poll(server, lambda s: not s[1]["is_processing"])[1]["id_task"] > running["id_task"]


def test_slot_actions_on_a_busy_slot_act_once_its_request_has_finished(server, slot_dir, monkeypatch):
    """As llama-server defers a slot task while its slot processes: a save, an erase and a restore sent
    while a request streams under slot 1 each act once that request has finished. The save holds the
    finished state (`tokens_cached`: the prompt and every generated token but the last), not that of a
    request for slot 1 sent while the save waited (counted in `llamacpp:requests_deferred`), which runs
    after it; the erase forgets it, and the restored tokens are the slot's after the request ends (an
    erase then counts them). A save whose client leaves while it waits writes nothing."""
    slow_decode_steps(monkeypatch)  # each stream runs long enough to send an action while it decodes
    file = {"filename": "busy.k3slot"}
    replies: dict = {}

    def save_then_a_later_request() -> None:
        saver = threading.Thread(
            target=lambda: replies.update(save=post(server, "/slots/1?action=save", file))
        )
        saver.start()
        _poll_metric(server, "llamacpp:requests_deferred", 1.0)  # the save waits for its slot
        later = {**GREEDY, "prompt": PROMPT + " later", "id_slot": 1, "n_predict": 3}
        replies["later"] = post(server, "/completion", later).json()
        saver.join(120)

    _, answer = _while_busy(server, 150, save_then_a_later_request)
    saved = replies["save"]
    assert saved.status_code == 200 and saved.json()["n_saved"] == answer["tokens_cached"]
    assert replies["later"]["tokens_cached"] != answer["tokens_cached"]
    erased, answer = _while_busy(server, 140, lambda: post(server, "/slots/1?action=erase", {}))
    assert erased.json() == {"id_slot": 1, "n_erased": answer["tokens_cached"]}
    restored, answer = _while_busy(server, 130, lambda: post(server, "/slots/1?action=restore", file))
    assert restored.json()["n_restored"] == saved.json()["n_saved"] != answer["tokens_cached"]
    assert post(server, "/slots/1?action=erase", {}).json()["n_erased"] == saved.json()["n_saved"]

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/slots/1?action=save",
                json={"filename": "left.k3slot"},
                headers=AUTH,
                timeout=0.5,
            )

    _while_busy(server, 150, leave)
    post(server, "/slots/1?action=save", file)  # acts after the one that was left: one action a slot
    assert not (slot_dir / "left.k3slot").exists()


def _while_busy(server, n_predict: int, action):
    """`action()` run while a greedy stream of `n_predict` tokens decodes under slot 1; what it returned
    and the stream's last chunk."""
    body = {"prompt": f"{PROMPT} busy {n_predict}", "id_slot": 1, "n_predict": n_predict, "stream": True}
    answer: list = []
    runner = threading.Thread(target=lambda: answer.append(_stream_last(server, {**GREEDY, **body})))
    runner.start()
    _poll(server, lambda s: s[1]["is_processing"] and 0 < s[1]["next_token"][0]["n_decoded"] < n_predict // 2)
    result = action()
    runner.join(120)
    return result, answer[0]


def _poll_metric(server, name: str, value: float) -> None:
    for _ in range(3000):  # a bound, not a timing assertion
        text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
        if re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1) == str(value):
            return
        time.sleep(0.005)
    raise AssertionError(f"/metrics never showed {name} {value}")


def _stream_last(server, body):
    with httpx.stream("POST", server.url + "/completion", json=body, headers=AUTH, timeout=120) as reply:
        lines = [line for line in reply.iter_lines() if line]
    return json.loads(lines[-1][len("data: ") :])


def _poll(server, condition):
    for _ in range(3000):  # a bound, not a timing assertion
        slots = httpx.get(server.url + "/slots", headers=AUTH, timeout=10).json()
        if condition(slots):
            return slots
        time.sleep(0.005)
    raise AssertionError(f"/slots never showed the expected state: {slots}")


def test_an_answer_the_context_ends_is_truncated_and_n_keep_cuts_no_prompt(server, served):
    """An answer that fills the context (prompt and output: 256 tokens) ends with `stop_type` `limit` and
    `truncated` true, streamed and whole, as llama-server ends one without context shift (which a hybrid
    model's recurrent state cannot do); one `n_predict` ends is not truncated. `n_keep`, `n_discard` and
    `n_cache_reuse` (context shift's and chunk reuse's, both off there for such a model) change nothing but
    `generation_settings`' echo, and a prompt past the context is refused whatever `n_keep` says, never
    cut to fit."""
    shift = {"n_keep": 4, "n_discard": 8, "n_cache_reuse": 16}
    full = complete(server, prompt=PROMPT, temperature=0, ignore_eos=True)
    assert (full["stop_type"], full["truncated"]) == ("limit", True)
    assert full["tokens_evaluated"] + full["tokens_predicted"] == served.ctx
    shifted = complete(server, prompt=PROMPT, temperature=0, ignore_eos=True, **shift)
    assert shifted["content"] == full["content"]
    settings = shifted["generation_settings"]  # llama-server's echo of what was asked
    assert (settings["n_keep"], settings["n_discard"], settings["repeat_last_n"]) == (4, 8, 64)
    assert [settings[k] for k in ("stream", "timings_per_token", "post_sampling_probs")] == [False] * 3
    assert (full["generation_settings"]["n_keep"], full["generation_settings"]["n_discard"]) == (0, 0)
    reply = httpx.post(
        server.url + "/completion",
        json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True},
        headers=AUTH,
        timeout=120,
    )
    last = json.loads(reply.text.strip().splitlines()[-1].removeprefix("data: "))
    assert (last["stop"], last["stop_type"], last["truncated"]) == (True, "limit", True)
    assert last["generation_settings"]["stream"] is True
    assert complete(server, prompt=PROMPT, **GREEDY)["truncated"] is False
    too_long = post(server, "/completion", {"prompt": list(range(1, served.ctx + 9)), "n_keep": 4})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["type"] == "exceed_context_size_error"
    assert "n_keep truncates no prompt: the model's recurrent state" in too_long.json()["error"]["message"]
