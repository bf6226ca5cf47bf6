"""The generation loop and the generate/chat commands.

Stop handling is checked with a scripted model (logits that force a known token sequence) so that every
stop case is exact; the loop itself and the CLI run on real tiny Kimi-K3 models.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import requires_llama
from k3stream.engine.generate import ContextFull, Sequence, generate
from k3stream.engine.sampling import SamplingParams
from k3stream.engine.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedModel:
    """Logits that make greedy decoding emit `script` token by token (then eos)."""

    def __init__(self, script: list[int], vocab_size: int, eos: int):
        self.script, self.vocab_size, self.eos = script, vocab_size, eos

    def new_state(self) -> dict:
        return {"step": 0}

    def _row(self, state: dict) -> torch.Tensor:
        step = state["step"]
        state["step"] += 1
        row = torch.zeros(self.vocab_size)
        row[self.script[step] if step < len(self.script) else self.eos] = 10.0
        return row

    def prefill(self, state: dict, tokens: list[int]) -> torch.Tensor:
        return torch.stack([torch.zeros(self.vocab_size)] * (len(tokens) - 1) + [self._row(state)])

    def decode(self, state: dict, token: int) -> torch.Tensor:
        return self._row(state)


def _scripted(tokenizer: Tokenizer, text: str) -> ScriptedModel:
    return ScriptedModel(tokenizer.encode(text), tokenizer.vocab_size, tokenizer.eos_id)


def _run(tokenizer, text: str, **params) -> tuple[object, list[str]]:
    pieces: list[str] = []
    result = generate(
        _scripted(tokenizer, text),
        tokenizer,
        [tokenizer.bos_id],
        SamplingParams(temperature=0, **params),
        on_text=pieces.append,
    )
    return result, pieces


def test_eos_stops_and_is_not_text(tokenizer):
    result, pieces = _run(tokenizer, "Hello world.")
    assert (result.text, result.finish_reason) == ("Hello world.", "stop")
    assert result.token_ids == tokenizer.encode("Hello world.") + [tokenizer.eos_id]
    assert "".join(pieces) == result.text
    assert result.completion_tokens == len(result.token_ids) and result.prompt_tokens == 1


def test_max_tokens(tokenizer):
    result, pieces = _run(tokenizer, "Hello world. The end is near.", max_tokens=3)
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    assert result.text == tokenizer.decode(tokenizer.encode("Hello world. The end is near.")[:3])
    assert "".join(pieces) == result.text


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (("end",), "Hello world. The "),  # spans several tokens, starts mid-token
        (("d. T",), "Hello worl"),
        (("near.", "world"), "Hello "),  # the earliest match wins
        (("lo w",), "Hel"),
        (("absent", "Hello world. The end is near.!"), "Hello world. The end is near."),
    ],
)
def test_stop_strings_are_cut_and_never_streamed(tokenizer, stop, expected):
    result, pieces = _run(tokenizer, "Hello world. The end is near.", stop=stop)
    assert result.text == expected
    assert "".join(pieces) == expected
    assert result.finish_reason == "stop"


def test_stop_string_prefixes_are_held_back_until_resolved(tokenizer):
    # tokens: H|el|lo| wor|l|d|.| The|...; "wor", "worl", "world" could still become "world!"
    sequence = Sequence(tokenizer, [tokenizer.bos_id], SamplingParams(temperature=0, stop=("world!",)))
    released = [sequence.accept(token) for token in tokenizer.encode("Hello world. The")]
    assert released == ["H", "el", "lo", " ", "", "", "world.", " The"]


def test_held_back_text_is_released_when_generation_ends(tokenizer):
    result, pieces = _run(tokenizer, "Hello world. The end is near.", stop=("world!",), max_tokens=5)
    assert result.text == "Hello worl" and result.finish_reason == "length"
    assert pieces[-1] == "worl"


def test_the_stop_word_that_ended_the_output_is_recorded(tokenizer):
    sequence = Sequence(tokenizer, [tokenizer.bos_id], SamplingParams(temperature=0, stop=("near", " end")))
    for token in tokenizer.encode("Hello world. The end is near."):
        sequence.accept(token)
        if sequence.done:
            break
    assert sequence.stop_word == " end" and sequence.text == "Hello world. The"


def test_repetition_penalty_counts_only_the_last_n_tokens(tokenizer):
    """llama-server's repeat_last_n: a token seen before the window is not penalised, one inside it is."""
    early, other = 5, 10
    logits = torch.zeros(tokenizer.vocab_size)
    logits[early], logits[other] = 2.0, 1.1  # penalised by 2, `early` falls below `other`
    prompt = [early, 7, 8, 9, 6]

    def choice(last_n: int) -> int:
        params = SamplingParams(temperature=0, repetition_penalty=2.0, repetition_last_n=last_n)
        return Sequence(tokenizer, prompt, params).choose(logits)

    assert choice(-1) == other and choice(5) == other  # `early` in the window
    assert choice(4) == early and choice(0) == early  # outside it; 0: no penalty


def _first_stop(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> str | None:
    """Reference: the text up to the first stop string, checked after each token as it arrives."""
    for t in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:t]).rstrip("\ufffd")
        found = [i for i in (prefix.find(stop) for stop in stops) if i >= 0]
        if found:
            return prefix[: min(found)]
    return None


_WORDS = st.sampled_from(
    ["Hello", " world", ".", " The", " end", " is", " near", "\n", " 中文", " 🙂", "ab", "c"]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(_WORDS, min_size=1, max_size=12), data=st.data())
def test_stop_strings_property(tokenizer, words, data):
    text = "".join(words)
    stops = tuple(
        data.draw(
            st.lists(
                st.one_of(
                    st.text("abcdHelo. \n中🙂", min_size=1, max_size=4),
                    st.sampled_from(
                        [text[i:j] for i in range(len(text)) for j in range(i + 1, len(text) + 1)]
                    ),
                ),
                max_size=3,
            )
        )
    )
    result, pieces = _run(tokenizer, text, stop=stops)
    expected = _first_stop(tokenizer, tokenizer.encode(text), stops)
    assert result.text == (text if expected is None else expected)
    assert "".join(pieces) == result.text


def test_stop_token_ids_and_multibyte_streaming(tokenizer):
    text = "中文 🙂 done"
    ids = tokenizer.encode(text)
    result, pieces = _run(tokenizer, text, stop_token_ids=(ids[-1],))
    assert result.finish_reason == "stop" and result.token_ids == ids
    assert result.text == tokenizer.decode(ids[:-1])
    assert "".join(pieces) == result.text and "\ufffd" not in result.text  # 🙂's split bytes were held


@pytest.mark.parametrize("end", ["eos", "max_tokens", "stop_token_ids"])
def test_a_stop_string_the_last_incomplete_character_completes_is_cut(tokenizer, end):
    """An answer that ends inside a UTF-8 sequence ends with U+FFFD, whatever ended it: a stop string
    ending with that U+FFFD is cut there as anywhere else, never sent."""
    byte_ids = {tokenizer.piece(token): token for token in range(tokenizer.vocab_size)}
    ids = tokenizer.encode("Hi") + [byte_ids[bytes([b])] for b in "🙂".encode()[:2]]  # two of its four bytes
    params = {"stop": ("i\ufffd",)}
    if end == "max_tokens":
        params["max_tokens"] = len(ids)
    elif end == "stop_token_ids":
        ids.append(tokenizer.encode(" done")[-1])
        params["stop_token_ids"] = (ids[-1],)
    pieces: list[str] = []
    model = ScriptedModel(ids, tokenizer.vocab_size, tokenizer.eos_id)
    result = generate(
        model, tokenizer, [tokenizer.bos_id], SamplingParams(temperature=0, **params), pieces.append
    )
    assert (result.text, result.finish_reason) == ("H", "stop")
    assert "".join(pieces) == "H"


def test_sequence_refuses_empty_prompts_and_extra_tokens(tokenizer):
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        Sequence(tokenizer, [], GREEDY)
    sequence = Sequence(tokenizer, [1], SamplingParams(temperature=0, max_tokens=1))
    sequence.accept(72)
    with pytest.raises(RuntimeError, match="already finished"):
        sequence.accept(72)


# ---- real tiny models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_path):
    import k3stream

    return k3stream.load(model_path)


def _greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no state reuse)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(torch.argmax(model.logits(tokens)[-1])))
    return tokens[len(prompt) :]


def test_greedy_generation_equals_stateless_recompute(model, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result = generate(model, tokenizer, prompt, params)
    assert result.token_ids == _greedy_by_recompute(model, prompt, 8)
    assert result.finish_reason == "length" and result.prompt_tokens == len(prompt)
    assert result.timings["decode_tokens_per_s"] > 0


class _ReplacedPrefill:
    """A wrapper that replaces `prefill` and forwards everything else to the model."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill(self, state, tokens):
        self.calls += 1
        return self.model.prefill(state, tokens)


def test_generation_prefills_the_output_matrix_on_the_last_token_alone(model, tokenizer, monkeypatch):
    """The model's `prefill_last` (one row through the output matrix, the last row of `prefill`'s
    logits); a wrapper that replaces `prefill` keeps its say."""
    from k3stream.engine.generate import prefill_last

    prompt = tokenizer.encode("The capital of France is")
    full = model.prefill(model.new_state(), prompt)[-1]
    rows = []
    head = model.lm_head
    monkeypatch.setattr(model, "lm_head", lambda x: rows.append(len(x)) or head(x))
    assert torch.allclose(prefill_last(model, model.new_state(), prompt), full, rtol=1e-5, atol=1e-5)
    assert rows == [1]
    wrapped = _ReplacedPrefill(model)
    assert torch.equal(
        prefill_last(wrapped, model.new_state(), prompt), model.prefill(model.new_state(), prompt)[-1]
    )
    assert wrapped.calls == 1


def _llama_greedy(model_path, prompt: list[int], n: int) -> tuple[list[int], float]:
    """llama.cpp's greedy continuation and the smallest top-1/top-2 logit gap along the way."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(model_path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt)
    tokens, gap = [], float("inf")
    for _ in range(n):
        logits = np.sort(np.asarray(llm.scores[llm.n_tokens - 1]))
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        gap = min(gap, float(logits[-1] - logits[-2]))
        llm.eval([tokens[-1]])
    return tokens, gap


@requires_llama
def test_greedy_generation_matches_llama_cpp(model, tokenizer, model_path):
    prompt = tokenizer.encode("The capital of France is")
    expected, gap = _llama_greedy(model_path, prompt, 10)
    assert gap > 1e-3, "near-tie in llama.cpp's logits: pick another prompt"
    result = generate(model, tokenizer, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert result.token_ids == expected


def test_sequences_driven_by_decode_batch_match_generate(model, tokenizer):
    prompts = [tokenizer.encode(text) for text in ("Hello, world!", "The capital of", "def fibonacci(n")]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 5)]
    sequences = [Sequence(tokenizer, p, sp) for p, sp in zip(prompts, params, strict=True)]
    states = [model.new_state() for _ in prompts]
    last = [
        seq.feed(model.prefill(state, seq.prompt_ids)[-1])[0]
        for seq, state in zip(sequences, states, strict=True)
    ]
    running = list(range(len(sequences)))
    while running:
        logits = model.decode_batch([states[i] for i in running], [last[i] for i in running])
        for row, i in enumerate(running):
            last[i], _done = sequences[i].feed(logits[row])
        running = [i for i in running if not sequences[i].done]
    for seq, prompt, sp in zip(sequences, prompts, params, strict=True):
        assert seq.token_ids == generate(model, tokenizer, prompt, sp).token_ids


def test_seeded_sampling_is_reproducible(model, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=6, ignore_eos=True)
    first = generate(model, tokenizer, prompt, params)
    assert generate(model, tokenizer, prompt, params).token_ids == first.token_ids
    other = generate(
        model,
        tokenizer,
        prompt,
        SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=6, ignore_eos=True),
    )
    assert other.token_ids != first.token_ids


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "k3stream.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@requires_llama
def test_a_raw_prompt_holding_special_token_text_prefills_llama_cpps_ids(model, tokenizer, model_path):
    """A chat turn written out by hand is the special tokens it names, as llama-cli tokenizes its prompt
    (parse_special): the prefill and the greedy answer follow those ids, not the text's letters."""
    import llama_cpp

    prompt = (
        "<|im_user|>user<|im_middle|>The capital of France is<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    ids = list(llama.tokenize(prompt.encode(), add_bos=False, special=True))
    llama.close()
    assert len(ids) < len(tokenizer.encode(prompt, allow_special=False))
    expected = generate(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=4)).text
    flags = ["--temperature", "0", "--max-tokens", "4", "--device", "cpu", "--threads", "1"]
    done = _cli("generate", str(model_path), "--prompt", prompt, *flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert f"prefill {len(ids)} tokens" in done.stderr


@pytest.mark.parametrize("chat", [False, True])
def test_generate_command_prints_the_library_result(model, tokenizer, model_path, chat):
    from k3stream.engine.chat import ChatTemplate

    prompt = "The capital of France is"
    text = (
        ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": prompt}])
        if chat
        else prompt
    )
    ids = tokenizer.encode(text, allow_special=chat)
    expected = generate(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=8)).text
    flags = ["--temperature", "0", "--max-tokens", "8", "--device", "cpu", "--threads", "1"]
    done = _cli("generate", str(model_path), "--prompt", prompt, *flags, *(["--chat"] if chat else []))
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "decode" in done.stderr and "tok/s" in done.stderr


def test_a_system_message_sends_the_prompt_through_the_chat_template(model, tokenizer, model_path):
    """`--system` (as llama-cli's `-sys`) is a chat's: it implies `--chat` instead of being dropped
    from a plain prompt."""
    from k3stream.engine.chat import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = tokenizer.encode(ChatTemplate.for_tokenizer(tokenizer).render(messages), allow_special=True)
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = generate(model, tokenizer, ids, params).text
    assert expected != generate(model, tokenizer, tokenizer.encode("Hello"), params).text
    flags = ["--temperature", "0", "--max-tokens", "6", "--device", "cpu", "--threads", "1"]
    done = _cli("generate", str(model_path), "--prompt", "Hello", "--system", "Be brief.", *flags)
    assert done.returncode == 0 and done.stdout == expected + "\n", done.stderr


def test_chat_command_keeps_the_conversation_as_the_tokens_the_model_saw(model, tokenizer, model_path):
    """As llama-cli: a turn's prompt is the ids the model saw (the last prompt and the tokens it answered
    with) and the new text tokenized after them, not the history tokenized again, whose ids differ where
    the model's tokens are not the tokenizer's choice (here: a special token the answer prints nothing
    for, and bytes that make no UTF-8). So the second turn reads the first answer as generated, and the
    prompt cache prefills only the new text. `/reset` forgets the turns, `/exit` ends."""
    from k3stream.engine.chat import ChatTemplate

    template = ChatTemplate.for_tokenizer(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=5)
    first = [{"role": "user", "content": "Hello"}]
    ids1 = tokenizer.encode(template.render(first), allow_special=True)
    answer1 = generate(model, tokenizer, ids1, params)
    said = [token for token in answer1.token_ids if token not in tokenizer.end_ids]
    assert tokenizer.encode_plain(answer1.text) != said  # the history tokenized again would differ
    second = [
        *first,
        {"role": "assistant", "content": answer1.text},
        {"role": "user", "content": "And then?"},
    ]
    new_text = template.render(second)[len(template.render(first) + answer1.text) :]
    ids2 = ids1 + said + tokenizer.encode(new_text, allow_special=True, add_bos=False)
    answer2 = generate(model, tokenizer, ids2, params)
    flags = ["--temperature", "0", "--max-tokens", "5", "--device", "cpu", "--threads", "1"]
    done = _cli("chat", str(model_path), *flags, stdin="Hello\nAnd then?\n/reset\nHello\n/exit\nnot read\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{answer1.text}\n{answer2.text}\n{answer1.text}\n"
    reused = re.findall(r"cache   (\d+) of (\d+) prompt tokens reused", done.stderr)
    fed = len(ids1) + len(answer1.token_ids) - 1  # the last token sampled is never fed
    assert [(int(a), int(b)) for a, b in reused] == [(0, len(ids1)), (fed, len(ids2)), (len(ids1),) * 2]


def test_command_errors_are_one_line(tmp_path, model_path):
    missing = _cli("generate", str(tmp_path / "missing.gguf"), "--prompt", "x")
    assert (missing.returncode, missing.stderr.splitlines()) == (
        1,
        [f"k3stream generate: error: model not found: {tmp_path}/missing.gguf"],
    )
    unserved = _cli("serve", str(tmp_path / "missing.gguf"), "--port", "0")  # refused before it binds
    assert (unserved.returncode, unserved.stdout, unserved.stderr.splitlines()) == (
        1,
        "",
        [f"k3stream serve: error: model not found: {tmp_path}/missing.gguf"],
    )
    folder = tmp_path / "folder.json"
    folder.mkdir()
    not_a_file = _cli("generate", str(folder), "--prompt", "x")  # an OSError (IsADirectoryError)
    assert not_a_file.returncode == 1 and len(not_a_file.stderr.splitlines()) == 1, not_a_file.stderr
    assert not_a_file.stderr.startswith("k3stream generate: error: ") and "folder.json" in not_a_file.stderr
    bad_flag = _cli("chat", str(model_path), "--top-p", "1.5", stdin="")
    assert (bad_flag.returncode, bad_flag.stderr.splitlines()) == (
        2,
        ["k3stream chat: error: --top-p must be in [0, 1], got 1.5"],
    )
    for threads in ("-1", "0"):  # llama.cpp's -t: every core (torch's set_num_threads refuses them)
        every_core = _cli("generate", str(model_path), "--prompt", "x", "-n", "2", "--threads", threads)
        assert every_core.returncode == 0, every_core.stderr


@pytest.fixture(scope="module")
def packed(tiny_model):
    """`(gguf, manifest)`: a tiny model with its expert pack beside it."""
    from k3stream.pack.builder import BuildOptions, build_pack

    gguf = tiny_model(seed=5)
    return gguf, build_pack(gguf, options=BuildOptions(progress=False)).manifest


def test_generate_streams_experts_from_the_pack(packed):
    from k3stream.engine.loading import load_runtime

    gguf, manifest = packed
    runtime = load_runtime(gguf, stream_experts=False)
    assert runtime.store is None
    prompt = "Hello, world!"
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = generate(runtime.model, runtime.tokenizer, runtime.tokenizer.encode(prompt), params).text
    args = ("--prompt", prompt, "--temperature", "0", "--max-tokens", "6", "--device", "cpu")
    beside = _cli("generate", str(gguf), *args)  # the pack next to the GGUF is found
    given = _cli("generate", str(manifest), *args, "--ram-mib", "0.1")
    no_prefetch = _cli("generate", str(manifest), *args, "--ram-mib", "0.1", "--policy=lru", "--no-prefetch")
    for done in (beside, given, no_prefetch):
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected + "\n"
        reads = re.search(r"^reads   (\d+) experts read from the pack \((\d+) read ahead", done.stderr, re.M)
        assert reads is not None and int(reads.group(1)) > 0, done.stderr
    assert re.search(r"^cache   ram: \d+ hits, [1-9]\d* misses", given.stderr, re.M), given.stderr
    assert re.search(r"\(0 read ahead, 0 of them used\)", no_prefetch.stderr), no_prefetch.stderr


def test_store_flags_reach_the_store_and_quiet_chat_counts_tokens(packed):
    import io

    from k3stream.cli import build_parser
    from k3stream.commands.chat import ChatSession
    from k3stream.commands.flags import runtime_from_args, sampling_params

    _gguf, manifest = packed

    def parse(*flags):
        argv = ["chat", str(manifest), "--device", "cpu", "--temperature", "0", "--max-tokens", "4", *flags]
        return build_parser(argv).parse_args(argv)

    def settings(runtime):
        stats = runtime.store.stats()
        return stats["tiers"]["ram"]["policy"], stats["prefetch"], runtime.model.prefetch

    default = runtime_from_args(parse())
    try:
        assert settings(default) == ("cycle", True, True)
        # O_DIRECT by default exactly when the pack does not fit the RAM budget
        store = default.store
        stats, expert_bytes = store.stats(), len(store.moe_layers) * store.num_experts * store.slot_bytes
        fits = expert_bytes <= stats["tiers"]["ram"]["budget_bytes"]
        assert (stats["direct_io_note"] == "off (auto): the whole pack fits the RAM budget") == fits
    finally:
        default.close()
    args = parse("--policy", "lru", "--no-prefetch", "--io-threads", "2", "--direct-io", "--quiet")
    runtime = runtime_from_args(args)
    try:
        assert settings(runtime) == ("lru", False, False)
        stats = runtime.store.stats()
        assert stats["direct_io_note"] != "not requested"  # O_DIRECT was asked for (and used or explained)
        assert stats["tokens"] == 0
        session = ChatSession(runtime, args, sampling_params(args))
        session.answer("Hello", io.StringIO())
        prompt = runtime.tokenizer.encode(session.template.render(session.messages[:1]), allow_special=True)
        assert runtime.store.stats()["tokens"] >= len(prompt) > 0  # counted although --quiet prints nothing
    finally:
        runtime.close()


def test_ctrl_c_stops_a_chat_answer_and_the_conversation_goes_on(model_path, monkeypatch):
    """Ctrl-C while an answer streams ends that answer (between model steps) and keeps the conversation,
    its partial answer included, as llama-cli does; the next line is answered."""
    import io

    from k3stream.cli import build_parser
    from k3stream.commands.chat import ChatSession, converse
    from k3stream.commands.flags import runtime_from_args, sampling_params

    argv = ["chat", str(model_path), "--device", "cpu", "--temperature", "0", "--max-tokens", "24", "--quiet"]
    args = build_parser(argv).parse_args(argv)
    runtime = runtime_from_args(args)

    class CtrlCOnFirstText(io.StringIO):
        def write(self, text: str) -> int:
            if not self.getvalue():
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the answer starts
            return super().write(text)

    try:
        whole = ChatSession(runtime, args, sampling_params(args))
        answers = [whole.answer(line, io.StringIO()) for line in ("Hello", "And then?")]
        assert len(runtime.tokenizer.encode(answers[0])) > 4  # several pieces of text to stop between
        session = ChatSession(runtime, args, sampling_params(args))
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAnd then?\n"))
        monkeypatch.setattr(sys, "stdout", CtrlCOnFirstText())
        converse(session)
        roles = [message["role"] for message in session.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        stopped, second = session.messages[1]["content"], session.messages[3]["content"]
        assert answers[0].startswith(stopped) and len(stopped) < len(answers[0])
        assert sys.stdout.getvalue() == f"{stopped}\n{second}\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        runtime.close()


def test_ctrl_c_during_generate_ends_the_texts_line(model_path, monkeypatch, capsys):
    """Ctrl-C while `generate` streams: status 130, and the text so far ends its line on stdout, as
    llama-cli's does, so the `interrupted` line and the shell's prompt start their own."""
    from k3stream.cli import main

    class CtrlCOnFirstText:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> int:
            self.text += text
            if len(self.text) == len(text):
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the text starts
            return len(text)

        def flush(self) -> None:
            pass

    stdout = CtrlCOnFirstText()
    monkeypatch.setattr(sys, "stdout", stdout)
    argv = ["generate", str(model_path), "-p", "Hello", "-n", "24", "--temp", "0", "--device", "cpu"]
    try:
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert stdout.text.endswith("\n") and len(stdout.text) > 1
    assert capsys.readouterr().err.splitlines()[-1] == "k3stream generate: interrupted"


def test_ctrl_c_before_any_text_prints_nothing_on_stdout(model_path, monkeypatch, capsys):
    """Ctrl-C while `generate` prefills, before any text: stdout stays empty (no empty line), the
    interruption is the one line on stderr, status 130."""
    import k3stream.engine.generate
    from k3stream.cli import main

    generate_text = k3stream.engine.generate.generate

    def ctrl_c_as_it_starts(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the prompt goes in
        return generate_text(*args, **kwargs)

    monkeypatch.setattr(k3stream.engine.generate, "generate", ctrl_c_as_it_starts)
    argv = ["generate", str(model_path), "-p", "Hello", "-n", "24", "--temp", "0", "--device", "cpu"]
    try:
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "k3stream generate: interrupted"


def test_ctrl_c_at_the_chat_prompt_ends_it_without_a_traceback(model_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "k3stream.cli",
        "chat",
        str(model_path),
        "--device",
        "cpu",
        "-n",
        "2",
        "--quiet",
    ]
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as chat:
        chat.stdin.write("Hello\n")
        chat.stdin.flush()
        chat.stdout.readline()  # the answer's first line
        # a Ctrl-C that lands while the answer is still printed stops the answer and the chat goes on
        # to its prompt, so the signal is sent until the chat ends (stdin stays open: no end of input)
        for _ in range(60):
            chat.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                chat.wait(timeout=1)
                break
        _, stderr = chat.communicate(timeout=60)
    assert chat.returncode == 130 and stderr.splitlines() == ["k3stream chat: interrupted"], stderr


def test_bad_store_flags_are_one_line_errors(packed):
    _gguf, manifest = packed
    bad_policy = _cli("generate", str(manifest), "--prompt", "x", "--policy", "fifo")
    assert bad_policy.returncode == 2 and "invalid choice: 'fifo'" in bad_policy.stderr
    no_threads = _cli("generate", str(manifest), "--prompt", "x", "--io-threads", "0", "--device", "cpu")
    assert (no_threads.returncode, no_threads.stderr.splitlines()[-1]) == (
        2,
        "k3stream generate: error: argument --io-threads: '0' is not a count of 1 or more",
    )


def test_kimi_k3_chat_stops_at_the_response_close():
    from k3stream.engine.chat import chat_stop_token_ids
    from k3stream.engine.tokenizer import VocabFields
    from k3stream.testing.tinyvocab import tiny_vocab

    vocab = tiny_vocab()
    fields = VocabFields(
        tokens=[*vocab.tokens, "<|close|>"],
        token_types=[*vocab.token_types, 3],
        model="gpt2",
        pre="kimi-k2",
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        merges=list(vocab.merges),
    )
    k3_style = Tokenizer(fields)
    assert chat_stop_token_ids(k3_style, thinking=False) == (len(vocab.tokens),)
    assert chat_stop_token_ids(k3_style, thinking=True) == ()
    assert (
        chat_stop_token_ids(
            Tokenizer(
                VocabFields(
                    **{
                        **fields.__dict__,
                        "tokens": list(vocab.tokens),
                        "token_types": list(vocab.token_types),
                    }
                )
            ),
            False,
        )
        == ()
    )


def test_generation_ends_when_the_context_is_full(tiny_model, tokenizer):
    import k3stream

    short = k3stream.load(tiny_model(context_length=12))
    prompt = tokenizer.encode("Hello, world! How are")
    assert len(prompt) < 12
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    result = generate(short, tokenizer, prompt, params)
    assert (result.finish_reason, result.prompt_tokens + result.completion_tokens) == ("length", 12)
    with pytest.raises(ContextFull, match="the prompt has 12 tokens; the context is 12"):
        generate(short, tokenizer, prompt + result.token_ids[:-1] + [1], params)
    within, longer = (generate(short, tokenizer, prompt[:4], params, context=c) for c in (6, None))
    assert (within.finish_reason, within.token_ids) == ("length", longer.token_ids[:2])  # a --ctx below 12
    assert len(longer.token_ids) == 8


def test_a_chat_line_ending_in_a_backslash_goes_on_in_the_next(model, tokenizer, model_path):
    """As llama-cli reads its input: lines ending in `\\` are one turn, their line breaks kept (a pasted
    paragraph is one question, not one turn a line); CR LF line ends are line ends."""
    from k3stream.engine.chat import ChatTemplate

    turn = [{"role": "user", "content": "Hello\nthere\nfriend"}]
    ids = tokenizer.encode(ChatTemplate.for_tokenizer(tokenizer).render(turn), allow_special=True)
    answer = generate(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=5)).text
    flags = ["--temperature", "0", "--max-tokens", "5", "--device", "cpu", "--quiet"]
    for end in ("\n", "\r\n"):  # a file written on Windows ends its lines in CR LF
        lines = f"Hello\\{end}there\\{end}friend{end}"
        done = _cli("chat", str(model_path), *flags, stdin=lines)
        assert done.returncode == 0 and done.stdout == f"{answer}\n", (end, done.stderr)


def test_ctx_bounds_what_the_generate_and_chat_commands_reach(model, tokenizer, model_path):
    """--ctx is the context the memory plan holds: no sequence goes past it. A prompt that fills it is a
    one-line error; a chat turn that cannot fit is refused in one line and the conversation goes on."""
    from k3stream.engine.chat import ChatTemplate

    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = generate(model, tokenizer, ids, params, context=len(ids) + 3)
    assert expected.completion_tokens == 3 < generate(model, tokenizer, ids, params).completion_tokens
    flags = ["--temperature", "0", "--max-tokens", "8", "--device", "cpu", "--threads", "1"]
    done = _cli("generate", str(model_path), "--prompt", prompt, "--ctx", str(len(ids) + 3), *flags)
    assert done.returncode == 0 and done.stdout == expected.text + "\n", done.stderr
    full = _cli("generate", str(model_path), "--prompt", prompt, "--ctx", str(len(ids)), *flags)
    assert (full.returncode, full.stderr.splitlines()) == (
        1,
        [f"k3stream generate: error: the prompt has {len(ids)} tokens; the context is {len(ids)}"],
    )
    turn = tokenizer.encode(
        ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": "Hello"}]),
        allow_special=True,
    )
    answer = generate(model, tokenizer, turn, SamplingParams(temperature=0, max_tokens=5)).text
    ctx = str(len(turn) + 6)  # the first turn and its answer fit, the second turn does not
    chat = _cli(
        "chat", str(model_path), "--temperature", "0", "--max-tokens", "5", "--device", "cpu", "--quiet",
        "--ctx", ctx, stdin="Hello\nAnd then?\n/reset\nHello\n",
    )  # fmt: skip
    assert chat.returncode == 0 and chat.stdout == f"{answer}\n{answer}\n", chat.stderr
    refused = [line for line in chat.stderr.splitlines() if line.startswith("k3stream chat:")]
    assert len(refused) == 1 and refused[0].endswith(f"the context is {ctx} (--ctx); /reset starts over")


def test_generate_with_a_cache_dir_resumes_a_prompt_a_run_before_it_left(model_path, tokenizer, tmp_path):
    """`generate --cache-dir DIR` is the prompt reuse its help and the prompt cache's manual promise
    (llama-cli's `--prompt-cache`): a second run over a longer prompt prefills only the new tokens, with
    the first run's text; `--cache-ram 0` beside it is still refused (reuse off)."""
    first, longer = "import os\n", "import os\nimport sys\n"
    assert tokenizer.encode(longer)[: len(tokenizer.encode(first))] == tokenizer.encode(first)
    flags = ["--temperature", "0", "-n", "3", "--device", "cpu", "--cache-dir", str(tmp_path / "states")]
    runs = [_cli("generate", str(model_path), "-p", prompt, *flags) for prompt in (first, longer, longer)]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    reused = [re.search(r"cache   (\d+) of (\d+) prompt tokens reused", run.stderr) for run in runs]
    assert [(int(found[1]), int(found[2])) for found in reused] == [
        (0, len(tokenizer.encode(first))),
        (len(tokenizer.encode(first)), len(tokenizer.encode(longer))),
        (len(tokenizer.encode(longer)), len(tokenizer.encode(longer))),
    ]
    assert runs[1].stdout == runs[2].stdout
    off = _cli("generate", str(model_path), "-p", first, *flags, "--cache-ram", "0")
    assert off.returncode == 2 and "--cache-dir needs --cache-ram above 0" in off.stderr


def test_generate_takes_llama_clis_prompt_file_and_n_minus_one(model, tokenizer, model_path, tmp_path):
    """llama-cli's `-f FILE` reads the prompt from a file (less its last line break; `-f -` from stdin,
    as a Unix tool reads `-`) and `-n -1` generates until the context is full; a missing file is a
    one-line error naming --file, and -n below 1 (but -1, -2) names -n."""
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    ctx = len(ids) + 5
    expected = generate(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=ctx), context=ctx)
    (tmp_path / "prompt.txt").write_text(prompt + "\n", encoding="utf-8")  # as an editor saves it
    flags = ["--temperature", "0", "--device", "cpu", "--threads", "1", "-c", str(ctx)]
    done = _cli("generate", str(model_path), "-f", str(tmp_path / "prompt.txt"), "-n", "-1", *flags)
    assert done.returncode == 0 and done.stdout == expected.text + "\n", done.stderr
    assert f"decode {expected.completion_tokens} tokens" in done.stderr
    piped = _cli("generate", str(model_path), "-f", "-", "-n", "-1", *flags, stdin=prompt + "\n")
    assert (piped.returncode, piped.stdout) == (0, done.stdout), piped.stderr
    missing = _cli("generate", str(model_path), "-f", str(tmp_path / "none.txt"), *flags)
    assert (missing.returncode, missing.stderr.splitlines()) == (
        1,
        [f"k3stream generate: error: --file: no such file: {tmp_path / 'none.txt'}"],
    )
    below = _cli("generate", str(model_path), "-p", prompt, "-n", "0", *flags)
    assert (
        below.returncode == 2
        and "-n: must be -1 (until the context is full) or at least 1, got 0" in below.stderr
    )


def test_llama_clis_frequency_and_presence_penalties_count_the_last_repeat_last_n_tokens(
    model, tokenizer, model_path
):
    """llama-cli's `--frequency-penalty` and `--presence-penalty` count the tokens its `--repeat-last-n`
    window holds (prompt and output), as llama-server's penalties sampler: the command's answer is the
    engine's with that window (`penalty_last_n`); the penalties change it on this prompt."""
    prompt = " ".join(["the cat sat on the mat"] * 15)
    ids = tokenizer.encode(prompt)
    penalties = {"frequency_penalty": 1.5, "presence_penalty": -8.0}  # below 0: a counted token gains

    def answer(**fields) -> str:
        return generate(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=10, **fields)).text

    windowed = answer(**penalties, penalty_last_n=64)
    assert windowed != answer()  # the penalties decide the answer on this prompt
    flags = ["--temperature", "0", "--max-tokens", "10", "--device", "cpu", "--threads", "1"]
    flags += ["--frequency-penalty", "1.5", "--presence-penalty", "-8"]
    done = _cli("generate", str(model_path), "--prompt", prompt, *flags)
    assert done.returncode == 0 and done.stdout == windowed + "\n", done.stderr


def test_the_repeat_penalty_counts_the_last_repeat_last_n_tokens_as_llama_clis(model, tokenizer, model_path):
    """llama-cli's `--repeat-penalty` counts the last `--repeat-last-n` tokens of prompt and output
    (default 64; -1 all of them), so a script's flags sample here as there."""
    prompt = " ".join(["the cat sat on the mat"] * 15)
    ids = tokenizer.encode(prompt)
    assert len(ids) > 64
    base = {"temperature": 0, "max_tokens": 10, "repetition_penalty": 3.0}
    window = {
        n: generate(model, tokenizer, ids, SamplingParams(**base, repetition_last_n=n)).text for n in (64, -1)
    }
    assert window[64] != window[-1]  # the window decides the answer on this prompt
    flags = [
        "--temperature",
        "0",
        "--max-tokens",
        "10",
        "--repeat-penalty",
        "3",
        "--device",
        "cpu",
        "--threads",
        "1",
    ]
    for last_n, more in ((64, []), (-1, ["--repeat-last-n", "-1"])):
        done = _cli("generate", str(model_path), "--prompt", prompt, *flags, *more)
        assert done.returncode == 0 and done.stdout == window[last_n] + "\n", (last_n, done.stderr)


def test_generate_into_a_reader_that_leaves_ends_quietly_as_head_expects(model, tokenizer, model_path):
    """`k3stream generate ... | head -c 5`: once the reader has left, the command ends with the status
    of a process SIGPIPE ended (141, as `yes | head`), with no error line or traceback."""
    answer = generate(
        model, tokenizer, tokenizer.encode("The"), SamplingParams(temperature=0, max_tokens=400)
    )
    assert answer.completion_tokens > 100  # text goes on long after the reader left
    argv = [sys.executable, "-m", "k3stream.cli", "generate", str(model_path), "--prompt", "The", "-n", "400"]
    flags = ["--temperature", "0", "--device", "cpu", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen([*argv, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as run:
        assert len(run.stdout.read(5)) == 5
        run.stdout.close()
        assert run.wait(timeout=120) == 141
        assert run.stderr.read() == b""


def test_generate_into_a_full_disk_says_the_output_failed(model_path):
    """`k3stream generate ... > /dev/full`: one line saying writing the output failed (the bare
    `[Errno 28]` named no file), status 1, no traceback."""
    flags = ["--temperature", "0", "--device", "cpu", "--threads", "1", "-n", "3"]
    argv = [sys.executable, "-m", "k3stream.cli", "generate", str(model_path), "--prompt", "The", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert (done.returncode, done.stderr) == (
        1,
        "k3stream generate: error: writing the output: No space left on device\n",
    )


def test_the_command_line_lets_idle_openmp_threads_spin_briefly_unless_told_otherwise(monkeypatch):
    import os

    from k3stream.cli import OPENMP_SPIN_ROUNDS, calm_openmp

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    calm_openmp()
    assert os.environ["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_ROUNDS) and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    calm_openmp()
    assert os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    calm_openmp()
    assert "GOMP_SPINCOUNT" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ignore_eos_generates_max_tokens_as_llama_clis(model, tokenizer, model_path, command):
    """llama-cli's `--ignore-eos`: the end-of-sequence and end-of-turn tokens are never drawn, so a draw
    that would have ended early runs to --max-tokens (the library's answer with those tokens banned)."""
    from k3stream.commands.flags import with_ends
    from k3stream.engine.chat import ChatTemplate, chat_stop_token_ids

    text = "Once upon a time"
    if command == "chat":
        rendered = ChatTemplate.for_tokenizer(tokenizer).render(
            [{"role": "user", "content": text}], thinking=False
        )
        ids, stops = tokenizer.encode(rendered, allow_special=True), chat_stop_token_ids(tokenizer, False)
    else:
        ids, stops = tokenizer.encode(text), ()
    sampling = SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=48)
    seed, ended = next(
        (seed, answer)
        for seed in range(200)
        if (
            answer := generate(model, tokenizer, ids, replace(sampling, seed=seed, stop_token_ids=stops))
        ).finish_reason
        == "stop"
    )
    expected = generate(
        model, tokenizer, ids, with_ends(replace(sampling, seed=seed, ignore_eos=True), tokenizer, stops)
    )
    assert expected.completion_tokens == 48 > ended.completion_tokens
    assert not {*tokenizer.end_ids, *stops} & set(expected.token_ids)
    flags = [
        "--temperature",
        "2",
        "--top-k",
        "0",
        "--top-p",
        "1",
        "--min-p",
        "0",
        "-n",
        "48",
        "--seed",
        str(seed),
    ]
    flags += ["--device", "cpu", "--threads", "1"]
    if command == "chat":
        plain = _cli("chat", str(model_path), *flags, "--quiet", stdin=f"{text}\n")
        ignoring = _cli("chat", str(model_path), *flags, "--ignore-eos", stdin=f"{text}\n")
    else:
        plain = _cli("generate", str(model_path), "-p", text, *flags)
        ignoring = _cli("generate", str(model_path), "-p", text, *flags, "--ignore-eos")
    assert plain.returncode == 0 and plain.stdout == _as_read(ended.text + "\n"), plain.stderr
    assert ignoring.returncode == 0 and ignoring.stdout == _as_read(expected.text + "\n"), ignoring.stderr
    assert "decode 48 tokens" in ignoring.stderr


def test_a_prompt_file_keeps_its_carriage_returns_as_llama_cli_reads_it(tokenizer, tmp_path):
    """llama-cli reads `-f` as bytes: a Windows file's `\r\n` and a lone `\r` are prompted as written
    (they were read as `\n`, other tokens), only the last `\n` dropped."""
    import argparse

    from k3stream.commands.generate import prompt_text

    data = b"line one\r\nline two\rthree\r\n"
    (tmp_path / "windows.txt").write_bytes(data)
    text = prompt_text(argparse.Namespace(file=tmp_path / "windows.txt", prompt=None))
    assert text.encode() == data[:-1]
    assert tokenizer.encode(text) != tokenizer.encode(text.replace("\r\n", "\n"))


def _as_read(text: str) -> str:
    """`text` as `_cli` reads a command's output: text mode turns each `\r\n` and `\r` into `\n`."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def test_prompt_escapes_are_replaced_as_llama_cli_does_unless_no_escape(
    model, tokenizer, model_path, tmp_path
):
    """llama-cli replaces `\\n`, `\\t`, ... in `-p` and `-f` prompts by default (`-e`); `--no-escape` takes
    the prompt as written."""
    written = r"Hello\n\tworld \x41"
    params = SamplingParams(temperature=0, max_tokens=6)
    escaped = generate(model, tokenizer, tokenizer.encode("Hello\n\tworld A"), params).text
    literal = generate(model, tokenizer, tokenizer.encode(written), params).text
    assert escaped != literal
    flags = ["--temperature", "0", "-n", "6", "--device", "cpu", "--threads", "1"]
    (tmp_path / "prompt.txt").write_text(written, encoding="utf-8")
    for source in (["-p", written], ["-f", str(tmp_path / "prompt.txt")], ["-p", written, "-e"]):
        done = _cli("generate", str(model_path), *source, *flags)
        assert done.returncode == 0 and done.stdout == escaped + "\n", (source, done.stderr)
    kept = _cli("generate", str(model_path), "-p", written, "--no-escape", *flags)
    assert kept.returncode == 0 and kept.stdout == literal + "\n", kept.stderr
    broken = _cli("generate", str(model_path), "-p", r"caf\xff", *flags)
    assert broken.returncode == 1 and len(broken.stderr.splitlines()) == 1 and "--prompt" in broken.stderr


def test_chat_messages_take_llama_clis_escapes_unless_no_escape(model, tokenizer, model_path):
    """llama-cli replaces escapes in each line typed in a conversation too; a line whose escapes make no
    UTF-8 text is refused in one line and the conversation goes on."""
    from k3stream.engine.chat import ChatTemplate

    template = ChatTemplate.for_tokenizer(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=5)

    def answer(text: str) -> str:
        ids = tokenizer.encode(template.render([{"role": "user", "content": text}]), allow_special=True)
        return generate(model, tokenizer, ids, params).text

    escaped, literal = answer("Hi\tyou"), answer(r"Hi\tyou")
    assert escaped != literal
    flags = ["--temperature", "0", "--max-tokens", "5", "--device", "cpu", "--threads", "1", "--quiet"]
    done = _cli("chat", str(model_path), *flags, stdin="caf\\xff\nHi\\tyou\n")
    assert done.returncode == 0 and done.stdout == f"{escaped}\n", done.stderr
    assert done.stderr.startswith("k3stream chat: this message: its escapes make bytes that are not UTF-8")
    kept = _cli("chat", str(model_path), *flags, "--no-escape", stdin="Hi\\tyou\n")
    assert kept.returncode == 0 and kept.stdout == f"{literal}\n", kept.stderr


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        (r"a\nb\rc\td", "a\nb\rc\td"),
        (r"\'\"\\", "'\"\\"),
        (r"\\n", "\\n"),  # an escaped backslash, then the letter
        (r"\x41\x4g\x4", "A\\x4g\\x4"),  # two hex digits make a byte; fewer stay as written
        (r"\xe4\xbd\xa0", "你"),  # bytes of UTF-8 text
        (r"\q\ ", "\\q\\ "),  # a backslash before anything else stays
        ("end\\", "end\\"),
        ("ü\\ü", "ü\\ü"),
    ],
)
def test_process_escapes_follows_llama_clis_rules(written, meant):
    from k3stream.commands.flags import process_escapes

    assert process_escapes(written, "--prompt") == meant


def test_a_system_prompt_file_is_llama_clis_sysf_for_generate_and_chat(
    model, tokenizer, model_path, tmp_path
):
    """llama-cli's `-sysf FILE` (`--system-prompt-file`): the file's bytes as they are (a CRLF stays) less
    its last line break are the system message, in `generate` and in `chat`; of `-sys` and `-sysf` the
    last given wins, as llama-cli assigns both to one field; a missing or non-UTF-8 file is one line
    naming the flag and the file, before the model loads."""
    from k3stream.engine.chat import ChatTemplate

    system = "You answer\r\nin French."
    (tmp_path / "system.txt").write_bytes(system.encode() + b"\n")
    template = ChatTemplate.for_tokenizer(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=4)

    def answer(messages: list[dict[str, str]]) -> str:
        return generate(
            model, tokenizer, tokenizer.encode(template.render(messages), allow_special=True), params
        ).text

    user = {"role": "user", "content": "Hello"}
    expected = answer([{"role": "system", "content": system}, user])
    assert expected != answer([user])  # the system message reaches the model
    flags = ["--temperature", "0", "-n", "4", "--device", "cpu", "--threads", "1", "--quiet"]
    sysf = ["-sysf", str(tmp_path / "system.txt")]
    for order in ([*sysf], ["-sys", "other", *sysf], ["--system-prompt-file", str(tmp_path / "system.txt")]):
        done = _cli("generate", str(model_path), "-p", "Hello", *order, *flags[:-1])
        assert done.returncode == 0 and done.stdout == _as_read(expected + "\n"), (order, done.stderr)
    chat = _cli("chat", str(model_path), *sysf, *flags, stdin="Hello\n")
    assert chat.returncode == 0 and chat.stdout == _as_read(expected + "\n"), chat.stderr
    overridden = _cli("generate", str(model_path), "-p", "Hello", *sysf, "-sys", "", *flags[:-1])
    assert overridden.returncode == 0 and overridden.stdout == _as_read(answer([user]) + "\n")
    (tmp_path / "latin1.txt").write_bytes("Réponds".encode("latin-1"))
    for command, source in (("generate", ["-p", "Hello"]), ("chat", [])):
        for name, why in (
            ("none.txt", "no such file: {path}"),
            ("latin1.txt", "{path}: not UTF-8 text (byte 1)"),
        ):
            path = tmp_path / name
            done = _cli(command, str(model_path), *source, "-sysf", str(path), *flags[:-1], stdin="")
            flag = "--system-prompt-file" + (": " if name == "none.txt" else " ")
            assert (done.returncode, done.stderr.splitlines()) == (
                1,
                [f"k3stream {command}: error: {flag}{why.format(path=path)}"],
            ), done.stderr


def test_a_saved_conversation_loads_in_another_chat_and_reuses_its_state_from_the_cache_dir(
    model_path, tmp_path
):
    """`/save FILE` keeps the messages and the ids the model saw; `/load FILE` in another run continues
    from them: the same greedy answer as one run holding both turns, and (with `--cache-dir`) the first
    turn's state read back from the cache, so only the new turn is prefilled. A file that is no saved
    conversation (missing, not JSON, a foreign JSON, a bad field) is one line naming it, and the
    conversation goes on; ids saved with another tokenizer are dropped and the messages tokenized again."""
    flags = ["--temperature", "0", "--max-tokens", "5", "--device", "cpu", "--threads", "1"]
    cached = [*flags, "--cache-dir", str(tmp_path / "cache")]
    saved = tmp_path / "talk.json"
    whole = _cli("chat", str(model_path), *flags, stdin="Hello\nAnd then?\n")
    first = _cli("chat", str(model_path), *cached, stdin=f"Hello\n/save {saved}\n")
    assert first.returncode == 0 and whole.returncode == 0, first.stderr + whole.stderr
    answers = whole.stdout.splitlines()
    assert first.stdout == answers[0] + "\n" and json.loads(saved.read_text())["format"] == "k3stream-chat-v1"
    (tmp_path / "not.json").write_text("{")
    (tmp_path / "foreign.json").write_text('{"complete": true}')
    record = json.loads(saved.read_text())
    (tmp_path / "bad.json").write_text(
        json.dumps({**record, "messages": [{"role": "narrator", "content": ""}]})
    )
    (tmp_path / "other.json").write_text(json.dumps({**record, "tokenizer_sha256": "0" * 64}))
    bad = ["missing.json", "not.json", "foreign.json", "bad.json"]
    lines = "".join(f"/load {tmp_path / name}\n" for name in bad)
    second = _cli("chat", str(model_path), *cached, stdin=f"/save\n{lines}/load {saved}\nAnd then?\n")
    assert second.returncode == 0 and second.stdout == answers[1] + "\n", second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("k3stream chat: ")]
    assert errors[0] == "k3stream chat: /save needs a file: /save FILE"
    assert errors[1] == f"k3stream chat: /load {tmp_path / 'missing.json'}: No such file or directory"
    for line, name in zip(errors[2:], bad[1:], strict=True):
        assert line.startswith(f"k3stream chat: /load {tmp_path / name}: "), line
    assert "not a k3stream chat file" in errors[3] and "field messages" in errors[4]
    reused = re.findall(r"cache   (\d+) of (\d+) prompt tokens reused", second.stderr)
    whole_reused = re.findall(r"cache   (\d+) of (\d+) prompt tokens reused", whole.stderr)
    assert reused == whole_reused[1:] and int(reused[0][0]) > 0  # the first turn's state, from the disk
    other = _cli("chat", str(model_path), *flags, stdin=f"/load {tmp_path / 'other.json'}\nAnd then?\n")
    assert other.returncode == 0 and other.stdout.endswith("\n"), other.stderr  # messages alone: re-tokenized
