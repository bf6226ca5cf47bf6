"""Reuse across turns: `generate` with a prompt cache, the `chat` command, and the server (the real
`openai` client against `k3stream serve` on 127.0.0.1): the second turn computes only its new tokens,
greedy answers equal reuse off token for token, and a restarted server resumes from --cache-dir."""

from __future__ import annotations

import io
import json

import openai
import pytest
import torch

import k3stream
from k3stream.commands.report import statistics_lines
from k3stream.engine.fingerprints import model_fingerprint
from k3stream.engine.generate import generate
from k3stream.engine.prompt_cache import PromptCache, _RowExactUsers
from k3stream.engine.sampling import SamplingParams
from k3stream.gguf.reader import K3Checkpoint
from k3stream.memlimit import MIB
from k3stream.quant.kernels import set_row_exact
from k3stream.server.live import ServerProcess
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_path):
    yield k3stream.load(model_path)
    set_row_exact(False)


def test_generate_with_a_cache_reuses_the_last_turn_and_answers_the_same(model, model_path, tokenizer):
    cache = PromptCache(model, model_fingerprint(K3Checkpoint.open(model_path).shards), 64 * MIB, every=32)
    first_prompt = tokenizer.encode("The first turn of a conversation about rivers")
    first = generate(model, tokenizer, first_prompt, GREEDY, cache=cache)
    second_prompt = first_prompt + first.token_ids + tokenizer.encode(" and then about the sea")
    second = generate(model, tokenizer, second_prompt, GREEDY, cache=cache)
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(first_prompt) + len(first.token_ids) - 1  # the response's end
    computed = len(second_prompt) - second.cached_tokens  # the prefill's rate counts these alone
    rate = second.timings["prefill_tokens_per_s"] * second.timings["prefill_s"]
    assert rate == pytest.approx(computed)
    assert statistics_lines(second, None, None, 0)[0].startswith(f"speed   prefill {computed} tokens at ")
    cold = generate(model, tokenizer, second_prompt, GREEDY)
    assert (second.token_ids, second.text) == (cold.token_ids, cold.text)


def test_a_cache_of_another_model_is_refused_by_generate_and_a_prefill(model, tiny_model, tokenizer):
    """A cache holds its model's states: `generate` or a prefill on another model of the same shapes
    (another seed) with it is refused in one line, never served that model's state."""
    from k3stream.engine.chunked_prefill import ChunkedPrefill

    cache = PromptCache(model, "first", 64 * MIB)
    prompt = tokenizer.encode("A prompt cached for the first model")
    generate(model, tokenizer, prompt, GREEDY, cache=cache)
    other = k3stream.load(tiny_model(seed=1))
    with pytest.raises(ValueError, match="prompt cache was made for another model"):
        generate(other, tokenizer, prompt + [5], GREEDY, cache=cache)
    with pytest.raises(ValueError, match="prompt cache was made for another model"):
        ChunkedPrefill(other, prompt + [5], cache)
    cache.close()


def test_one_generated_token_reports_no_decode_rate(model, tokenizer):
    """With one token, the prefill made it: the report says so instead of 'decode 1 tokens at 0.0 tok/s'."""
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    one = generate(model, tokenizer, tokenizer.encode("A river"), one_token)
    line = statistics_lines(one, None, None, 0)[0]
    assert one.completion_tokens == 1 and "1 token from the prefill, no decode step" in line
    assert "tok/s (finish" not in line


def test_an_answer_stopped_by_its_text_callback_keeps_its_exact_state(model, model_path, tokenizer):
    """`chat`'s Ctrl-C: `on_text` raises StopGeneration at the third piece. The state at the partial
    answer's end is snapshotted: a restore of it gives the cold prefill's logits bit for bit, and the
    next turn restores it and answers as a cold run does."""
    from k3stream.engine.generate import StopGeneration, prefill_last

    cache = PromptCache(model, model_fingerprint(K3Checkpoint.open(model_path).shards), 64 * MIB, every=32)
    prompt = tokenizer.encode("A turn whose answer the user stops early")
    pieces: list[str] = []

    def stop_at_the_third(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            raise StopGeneration

    stopped = generate(model, tokenizer, prompt, GREEDY, on_text=stop_at_the_third, cache=cache)
    assert stopped.finish_reason == "stop" and 3 <= len(stopped.token_ids) < GREEDY.max_tokens
    assert stopped.text.startswith("".join(pieces))
    fed = prompt + stopped.token_ids[:-1]  # the last token sampled never went through the model
    restored = cache.restore_exact(fed)
    assert restored is not None
    cold = model.new_state()
    assert torch.equal(
        model.decode(restored, stopped.token_ids[-1]), prefill_last(model, cold, fed + stopped.token_ids[-1:])
    )
    after = fed + stopped.token_ids[-1:] + tokenizer.encode(" and the next turn")
    warm = generate(model, tokenizer, after, GREEDY, cache=cache)
    assert warm.cached_tokens == len(fed)
    assert warm.token_ids == generate(model, tokenizer, after, GREEDY).token_ids


def test_chat_keeps_its_conversation_state_between_turns(model_path):
    from k3stream.cli import build_parser
    from k3stream.commands.chat import ChatSession
    from k3stream.commands.flags import runtime_from_args, sampling_params

    def conversation(*flags: str) -> tuple[list[str], ChatSession]:
        argv = ["chat", str(model_path), "--device", "cpu", "--temperature", "0", "--max-tokens", "6"]
        args = build_parser([*argv, *flags]).parse_args([*argv, "--quiet", *flags])
        runtime = runtime_from_args(args)
        try:
            session = ChatSession(runtime, args, sampling_params(args))
            return [session.answer(text, io.StringIO()) for text in ("Hello there", "Tell me more")], session
        finally:
            runtime.close()

    answers, session = conversation()
    first_prompt = session.template.render(session.messages[:1])
    first_tokens = len(session.runtime.tokenizer.encode(first_prompt, allow_special=True))
    assert session.cache.stats.hits == 1  # the second turn
    assert session.cache.stats.tokens_reused >= first_tokens  # at least the first turn's whole prompt
    off_answers, off_session = conversation("--cache-ram", "0")
    assert off_session.cache is None and answers == off_answers
    _RowExactUsers.leave()  # the reuse-off chat's `keep_row_exact`
    set_row_exact(False)


def _chat(client: openai.OpenAI, messages: list[dict]) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="tiny-kimi-k3", messages=messages, max_tokens=6, temperature=0, logprobs=True
    )


def _logprobs(response: openai.types.chat.ChatCompletion) -> list[float]:
    return [token.logprob for token in response.choices[0].logprobs.content]


def _two_turns(client: openai.OpenAI) -> tuple[list, list]:
    messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Hi"}]
    first = _chat(client, messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "And the next step?"}]
    return [first, _chat(client, messages)], messages


@pytest.mark.slow
def test_the_server_reuses_a_conversation_and_resumes_it_after_a_restart(model_path, tmp_path):
    cache_dir = str(tmp_path / "states")
    with ServerProcess(
        model_path, "--threads", "1", "--cache-dir", cache_dir, log_path=tmp_path / "a.log"
    ) as on:
        client = openai.OpenAI(base_url=on.url + "/v1", api_key="none", max_retries=0, timeout=120)
        (first, second), messages = _two_turns(client)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        assert cached >= first.usage.prompt_tokens  # at least the first turn's whole prompt
        stream = client.chat.completions.create(
            model="tiny-kimi-k3", messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens  # seen whole
        completion = client.completions.create(
            model="tiny-kimi-k3", prompt="Once upon a time", max_tokens=4, temperature=0
        )
        assert completion.usage.prompt_tokens_details.cached_tokens == 0
        metrics = _metrics(on.url)
        assert _sample(metrics, "k3stream_prompt_tokens_reused_total") >= cached
        assert _sample(metrics, 'k3stream_prompt_cache_snapshots{tier="disk"}') >= 2
    with ServerProcess(model_path, "--threads", "1", "--cache-ram", "0", log_path=tmp_path / "b.log") as off:
        client = openai.OpenAI(base_url=off.url + "/v1", api_key="none", max_retries=0, timeout=120)
        (off_first, off_second), _ = _two_turns(client)
        assert off_second.usage.prompt_tokens_details.cached_tokens == 0
    assert [r.choices[0].message.content for r in (first, second)] == [
        r.choices[0].message.content for r in (off_first, off_second)
    ]
    # reuse off computes as reuse on does (row-exact products), the same bits with or without a restore
    assert [_logprobs(r) for r in (first, second)] == [_logprobs(r) for r in (off_first, off_second)]
    with ServerProcess(
        model_path, "--threads", "1", "--cache-dir", cache_dir, log_path=tmp_path / "c.log"
    ) as again:
        client = openai.OpenAI(base_url=again.url + "/v1", api_key="none", max_retries=0, timeout=120)
        resumed = _chat(client, messages)
        assert resumed.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
        assert resumed.choices[0].message.content == second.choices[0].message.content


@pytest.mark.slow
def test_a_server_started_over_its_disk_budget_trims_other_keys_folders_first(model, model_path, tmp_path):
    """`serve --cache-disk` bounds the whole --cache-dir: started over it, the server removes the
    snapshots of another key's folder that no process holds before it serves, and says so on its
    startup line and on /metrics; what is not k3stream's stays."""
    directory = tmp_path / "states"
    other = PromptCache(model, "0" * 16, 64 * MIB, directory, 1 << 30)  # another model file's folder
    other.prefill(list(range(40)))
    other.close()
    (foreign,) = other.disk_dir.glob("*.k3snap")
    size = foreign.stat().st_size
    kept = directory / "notes.txt"
    kept.write_text("not k3stream's")
    log = tmp_path / "serve.log"
    budget = f"{size / 2 / (1 << 30)!r}"  # GiB: half the foreign file
    with ServerProcess(
        model_path, "--threads", "1", "--cache-dir", str(directory), "--cache-disk", budget, log_path=log
    ) as server:
        metrics = _metrics(server.url)
    assert "removed 1 snapshots of other folders" in log.read_text()
    assert "1 emptied folders" in log.read_text()
    assert _sample(metrics, 'k3stream_prompt_cache_dir_removed_total{kind="foreign_snapshot"}') == 1
    assert _sample(metrics, 'k3stream_prompt_cache_dir_removed_bytes_total{kind="foreign_snapshot"}') == size
    assert _sample(metrics, 'k3stream_prompt_cache_dir_removed_total{kind="foreign_folder"}') == 1
    assert _sample(metrics, 'k3stream_prompt_cache_dir_bytes{folder="foreign"}') == 0
    assert not other.disk_dir.exists() and kept.exists()


def _metrics(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics", timeout=10).text


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_chunked_prefills_beside_a_running_stream_answer_as_each_request_alone(model_path):
    """Prompts prefilled 16 tokens between decode steps, while other requests stream, give the greedy
    answers of `generate` on each prompt alone, whole (the cache's row-exact products: the same bits)."""
    from concurrent.futures import ThreadPoolExecutor

    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread
    from k3stream.server.runtime import served_from_runtime

    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    served.prompt_cache = PromptCache(served.model, "chunked", 64 * MIB, every=24)
    tokenizer, model = served.tokenizer, served.model
    prompts = [" ".join(["river", "stone", "cloud", "seed"][i:] * (12 + 9 * i)) for i in range(4)]
    expected = [generate(model, tokenizer, tokenizer.encode(text), GREEDY).text for text in prompts]
    app = create_app(served, ServerConfig(max_batch=4, prefill_chunk=16))
    with ServerThread(app) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def complete(text: str) -> str:
            reply = client.completions.create(
                model=served.name, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            return reply.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(complete, prompts))
    served.prompt_cache.close()
    served.close()
    assert answers == expected


def test_timings_count_computed_and_cached_prompt_tokens_as_llama_server(model_path):
    """llama-server's `timings.prompt_n` is the prompt tokens computed, `cache_n` those reused: a repeated
    prompt's rate is over the tokens it prefilled, not the whole prompt."""
    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread
    from k3stream.server.runtime import served_from_runtime

    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    served.prompt_cache = PromptCache(served.model, "timings", 64 * MIB, every=16)
    with ServerThread(create_app(served, ServerConfig(max_batch=1))) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt = " ".join(["river", "stone", "cloud"] * 15)
        answers = [
            client.completions.create(model=served.name, prompt=prompt, max_tokens=2) for _ in range(2)
        ]
    served.prompt_cache.close()
    served.close()
    for answer in answers:
        cached, timings = answer.usage.prompt_tokens_details.cached_tokens, answer.model_extra["timings"]
        assert timings["cache_n"] == cached and timings["prompt_n"] == answer.usage.prompt_tokens - cached
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0


def test_the_server_cuts_prompts_by_equal_work_where_the_experts_are_in_ram(model_path):
    """`serve` with resident experts cuts a long prompt into chunks of equal work: a chunk deep in it,
    whose tokens attend over more rows, takes fewer tokens than `--prefill-chunk`."""
    from k3stream.engine.chunked_prefill import attention_rows_per_token
    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.runtime import served_from_runtime

    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    chunks = create_app(served, ServerConfig(prefill_chunk=64)).state.scheduler.chunks
    served.close()
    assert chunks.rows_per_token == attention_rows_per_token(served.model.config)
    deep = chunks.next_end(3000, 4096)  # where a chunk starts, ~3,000 tokens in
    assert chunks.next_end(0, 4096) == 64 and chunks.next_end(deep, 4096) - deep < 32


def test_a_prompt_alone_takes_one_pass_of_its_plans_rows_and_beside_a_stream_its_chunks(
    model_path, tokenizer
):
    """`serve`'s scheduler (512-token chunks; passes of four chunks' rows, what its memory plan holds)
    prefills a turn of 644 new tokens over a cached history in one pass when no other sequence decodes
    (more passes would each cost a pass's fixed part again and spare no stream), and in its chunks
    beside a running stream, which then waits about one chunk at a time. A new prompt (nothing
    restored) takes one chunk first, during which requests sharing its prefix can arrive and wait for
    it, then the rest in one pass. Every answer is its prompt's alone, whole."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import PREFILL_PASS_PROMPTS, ServerConfig, create_app
    from k3stream.server.runtime import served_from_runtime
    from k3stream.server.scheduler import EventSink, Job

    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    served.prompt_cache = PromptCache(served.model, "alone", 64 * MIB, every=1 << 20)
    generator = torch.Generator().manual_seed(644)
    history = torch.randint(10, 500, (600,), generator=generator).tolist()
    turns = [history + torch.randint(10, 500, (644,), generator=generator).tolist() for _ in range(2)]
    turns.append([7] + torch.randint(10, 500, (1243,), generator=generator).tolist())  # a new prompt
    served.prompt_cache.prefill(history)
    expected = [generate(served.model, tokenizer, ids, GREEDY, context=4096).token_ids for ids in turns]
    gate = served.model = _GatedPasses(served.model)
    gate.open()  # records the passes' rows
    scheduler = create_app(served, ServerConfig(max_batch=2, prefill_chunk=512)).state.scheduler
    loop = asyncio.new_event_loop()
    alone, beside, new = (Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)) for ids in turns)
    stream = Job(tokenizer.encode("a stream"), _Greedy(1 << 20), EventSink(loop))
    passes = {}
    scheduler.start()
    try:
        for job, name in ((alone, "alone"), (new, "new")):
            before = gate.entered
            scheduler.submit(job)
            wait_until(lambda job=job: job.logic.finish_reason is not None, f"the {name} prompt finishes")
            passes[name] = gate.rows[before:]
        scheduler.submit(stream)
        wait_until(lambda: stream.generated, "the stream decodes")
        before = gate.entered
        scheduler.submit(beside)
        wait_until(lambda: beside.logic.finish_reason is not None, "the turn beside the stream finishes")
        passes["beside"] = gate.rows[before:]
    finally:
        stream.cancel()
        scheduler.stop()
        loop.close()
        served.prompt_cache.close()
        served.close()
    chunks, position, cuts = scheduler.chunks, len(history), []
    while position < len(turns[1]):
        end = chunks.next_end(position, len(turns[1]))
        position, cuts = end, [*cuts, end - position]
    assert passes["alone"] == [644] and passes["beside"] == cuts and len(cuts) >= 2
    assert passes["new"] == [512, 1244 - 512]
    assert alone.cached_tokens == beside.cached_tokens == len(history) and new.cached_tokens == 0
    assert [job.logic.token_ids for job in (alone, beside, new)] == expected
    # no pass takes more rows than the plan holds for one
    assert scheduler.idle_chunks.next_end(0, 10_000) == 512 * PREFILL_PASS_PROMPTS


def test_prompts_that_arrive_together_at_an_idle_server_take_passes_within_the_plans_rows(model, tokenizer):
    """Eight prompts queued at once, no sequence decoding: the first pass takes whole prompts, oldest
    first, while their rows fit the memory plan's for a pass (1,024: five of 200 tokens, where their
    work would fit all eight), and no pass holds more; every answer is the prompt's alone."""
    from k3stream.engine.chunked_prefill import attention_rows_per_token

    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(10, 500, (200,), generator=generator).tolist() for _ in range(8)]
    gate = _GatedPasses(model)
    gate.open()  # records the passes' rows
    cache = PromptCache(model, "rows", 64 * MIB, every=1 << 20)
    # `share_tokens` 0: no request waits for another's prefix, so new prompts' first passes are not chunks
    sizes = {"max_batch": 8, "max_queue": 8, "prefill_chunk": 32, "pass_rows": 1024, "share_tokens": 0}
    sizes["attention_rows"] = attention_rows_per_token(model.config)  # as `serve` from the GGUF
    try:
        scheduler, jobs = _run_together(gate, tokenizer, cache, prompts, **sizes)
    finally:
        cache.close()
    idle = scheduler.idle_chunks
    assert 8 * idle.cost(0, 200) <= idle.budget  # the work alone would take all eight
    assert gate.rows[0] == 5 * 200 and max(gate.rows) <= 1024
    _assert_each_answers_as_alone(jobs, prompts, model, tokenizer)


def test_a_running_stream_waits_at_most_one_chunk_between_its_tokens(model, tokenizer):
    """Beside a running stream, two long prompts prefill in chunks of equal work: between two decode
    steps of the stream the scheduler runs at most one prefill pass, whose work (its rows and the rows
    they attend over, `PrefillChunks.cost`, each prompt's chunk added) is at most one chunk's, so the
    stream waits about one chunk per token whatever the prompts' lengths. Each answer is its prompt's
    alone."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.scheduler import EventSink, Job

    generator = torch.Generator().manual_seed(36)
    prompts = [torch.randint(10, 500, (length,), generator=generator).tolist() for length in (480, 360)]
    recorded = _RecordedCalls(model)
    cache = PromptCache(model, "beside", 64 * MIB, every=1 << 20)
    scheduler = _chunked_scheduler(recorded, cache, model)
    loop = asyncio.new_event_loop()
    stream = Job(tokenizer.encode("a stream"), _Greedy(1 << 20), EventSink(loop))
    jobs = [Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)) for ids in prompts]
    scheduler.start()
    try:
        scheduler.submit(stream)
        wait_until(lambda: len(stream.generated) > 1, "the stream decodes")
        start = len(recorded.calls)
        for job in jobs:
            scheduler.submit(job)
        wait_until(lambda: all(job.logic.finish_reason is not None for job in jobs), "the prompts finish")
    finally:
        stream.cancel()
        scheduler.stop()
        loop.close()
        cache.close()
    calls = recorded.calls[start:]
    passes_between, passes = [0], []
    for kind, spans in calls:
        if kind == "decode":
            passes_between.append(0)
        else:
            passes_between[-1] += 1
            passes.append(sum(scheduler.chunks.cost(begin, end) for begin, end in spans))
    assert len(passes) >= 2 * len(prompts) and max(passes_between) == 1
    assert max(passes) <= scheduler.chunks.budget * (1 + 1e-9)
    _assert_each_answers_as_alone(jobs, prompts, model, tokenizer)


def test_a_turns_restore_and_its_prompt_end_snapshot_take_steps_of_their_own_beside_a_stream(
    model, tokenizer
):
    """A conversation's next turn starts by restoring its history from the prompt cache and ends its
    prefill with a snapshot of the prompt's end, each a copy of its state: beside a running stream each
    is the prompt work between two of the stream's decode steps, never beside a prefill pass, so the
    stream waits for one of them at a time. The turn computes only its new tokens and answers as its
    prompt alone."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.scheduler import EventSink, Job

    generator = torch.Generator().manual_seed(37)
    history = torch.randint(10, 500, (300,), generator=generator).tolist()
    turn = history + torch.randint(10, 500, (90,), generator=generator).tolist()
    recorded = _RecordedCalls(model)
    cache = _RecordedRestores(model, recorded.calls)
    scheduler = _chunked_scheduler(recorded, cache, model)
    loop = asyncio.new_event_loop()
    stream = Job(tokenizer.encode("a stream"), _Greedy(1 << 20), EventSink(loop))
    first, second = (Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)) for ids in (history, turn))
    scheduler.start()
    try:
        scheduler.submit(stream)
        scheduler.submit(first)
        wait_until(lambda: first.logic.finish_reason is not None, "the first turn finishes")
        start = len(recorded.calls)
        scheduler.submit(second)
        wait_until(lambda: second.logic.finish_reason is not None, "the next turn finishes")
    finally:
        stream.cancel()
        scheduler.stop()
        loop.close()
        cache.close()
    between = [[]]
    for kind, _ in recorded.calls[start:]:
        if kind == "decode":
            between.append([])
        else:
            between[-1].append(kind)
    assert ["restore"] in between and ["end"] in between
    assert all("pass" not in work or work == ["pass"] for work in between)
    assert second.cached_tokens == len(history)
    _assert_each_answers_as_alone([second], [turn], model, tokenizer)


def test_only_a_request_that_asks_for_its_progress_gets_progress_events(model, tokenizer):
    """The scheduler puts a request's prefill progress on its queue only where its client streams it
    (llama-server's return_progress): each event wakes the server's event loop, which for any other
    request has nothing to send, beside the chunks of running streams. Both get the same answer."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, ProgressEvent, Scheduler

    prompt = torch.randint(10, 500, (200,), generator=torch.Generator().manual_seed(38)).tolist()
    loop = asyncio.new_event_loop()
    jobs = [
        Job(prompt, Sequence(tokenizer, prompt, GREEDY), EventSink(loop), sends_progress=sends)
        for sends in (False, True)
    ]
    scheduler = Scheduler(model, ServerMetrics(), max_batch=1, max_queue=2, prefill_chunk=64)
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        wait_until(lambda: all(job.logic.finish_reason is not None for job in jobs), "both finish")
        loop.run_until_complete(asyncio.sleep(0))  # the events the scheduler put
    finally:
        scheduler.stop()
    progress = [[e for _, e in _drained(job.sink.queue) if isinstance(e, ProgressEvent)] for job in jobs]
    loop.close()
    assert progress[0] == [] and [event.processed for event in progress[1]][-1] == len(prompt)
    assert len(progress[1]) >= 2 and jobs[0].logic.token_ids == jobs[1].logic.token_ids


def _chunked_scheduler(recorded, cache, model):
    """A scheduler over `recorded` calls and `cache` that prefills in chunks of 32 tokens (costed by the
    model's attention rows, as `serve` costs them), three sequences at most."""
    from k3stream.engine.chunked_prefill import attention_rows_per_token
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import Scheduler

    rows = attention_rows_per_token(model.config)
    return Scheduler(
        recorded,
        ServerMetrics(),
        max_batch=3,
        max_queue=3,
        cache=cache,
        prefill_chunk=32,
        attention_rows=rows,
    )


def _drained(queue) -> list:
    events = []
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


class _RecordedRestores(PromptCache):
    """A prompt cache that records into `calls` each restore of a state, `("restore", tokens)`, and
    each snapshot of a prompt's end, `("end", tokens)`."""

    def __init__(self, model, calls: list) -> None:
        super().__init__(model, "recorded", 64 * MIB, every=1 << 20)
        self.calls = calls

    def restore_longest(self, tokens):
        state, reused, logits = super().restore_longest(tokens)
        if reused:
            self.calls.append(("restore", reused))
        return state, reused, logits

    def save(self, tokens, state, logits=None, final=False) -> None:
        if logits is not None:
            self.calls.append(("end", len(tokens)))
        super().save(tokens, state, logits, final)


class _RecordedCalls:
    """The model with its prefill passes and decode steps recorded in order: `("pass", spans)` with each
    prompt's positions `(start, end)`, `("decode", sequences)`."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill_last(self, state, tokens):
        tokens = list(tokens)
        self.calls.append(("pass", [(state.length, state.length + len(tokens))]))
        return self.model.prefill_last(state, tokens)

    def prefill_batch(self, states, token_lists):
        spans = [
            (state.length, state.length + len(tokens))
            for state, tokens in zip(states, token_lists, strict=True)
        ]
        self.calls.append(("pass", spans))
        return self.model.prefill_batch(states, token_lists)

    def decode_batch(self, states, tokens):
        self.calls.append(("decode", len(states)))
        return self.model.decode_batch(states, tokens)


def _assert_each_answers_as_alone(jobs, prompts, model, tokenizer) -> None:
    """Each job's greedy answer equals its prompt's generated alone."""
    for job, ids in zip(jobs, prompts, strict=True):
        assert job.logic.token_ids == generate(model, tokenizer, ids, GREEDY).token_ids


def _assert_third_restored_the_prefix(jobs, prompts, cache, shared, model, tokenizer) -> None:
    """Of three requests only the third restored the `shared` prefix, so the prompts' tokens less it
    once were computed, and each answer equals its prompt's alone."""
    assert [job.cached_tokens for job in jobs] == [0, 0, shared]
    assert cache.stats.tokens_computed == sum(map(len, prompts)) - shared
    _assert_each_answers_as_alone(jobs, prompts, model, tokenizer)


def _run_together(model, tokenizer, cache, prompts, **sizes):
    """A greedy job per prompt, all queued before a `Scheduler` over `cache` (`sizes`: its max_batch,
    max_queue, prefill_chunk) starts, run until every one finishes: (the scheduler, the jobs)."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, Scheduler

    loop = asyncio.new_event_loop()
    jobs = [Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)) for ids in prompts]
    scheduler = Scheduler(model, ServerMetrics(), cache=cache, **sizes)
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        wait_until(lambda: all(job.logic.finish_reason is not None for job in jobs), "all finish")
    finally:
        scheduler.stop()
        loop.close()
    return scheduler, jobs


def test_waiting_prefills_share_one_pass_and_answer_as_each_alone(model, model_path, tokenizer):
    cache = PromptCache(model, "batched", 64 * MIB, every=16)
    prompts = [tokenizer.encode(" ".join(["sun", "moon", "star"][i % 3 :] * (5 + 7 * i))) for i in range(4)]
    # all waiting before the loop starts: one pass prefills them
    sizes = {"max_batch": 4, "max_queue": 4, "prefill_chunk": 512}
    scheduler, jobs = _run_together(model, tokenizer, cache, prompts, **sizes)
    assert scheduler.snapshot()["batched_prefills"] >= 1
    _assert_each_answers_as_alone(jobs, prompts, model, tokenizer)


class _Greedy:
    """A request's logic: greedy, `count` tokens, each sent as text (so each step puts one event)."""

    def __init__(self, count: int) -> None:
        self.count, self.completion_tokens, self.finish_reason = count, 0, None

    def choose(self, logits) -> int:
        return int(logits.argmax())

    def accept(self, token: int) -> str:
        self.completion_tokens += 1
        if self.completion_tokens == self.count:
            self.finish_reason = "length"
        return f"<{token}>"


def test_the_first_token_and_the_finish_are_sent_before_their_snapshots(model, tokenizer):
    """The scheduler sends a request's first token before it snapshots the prompt's end, and its finish
    before it snapshots the response's end: neither snapshot is on the client's path. Both still restore
    the cold state: the logits after each equal a cold prefill's, bit for bit."""
    import asyncio
    import time

    import torch

    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, FinishEvent, Job, PieceEvent, Scheduler

    cache = PromptCache(model, "order", 64 * MIB, every=1 << 20)  # snapshots at the ends only
    seen: list[tuple[str, int]] = []

    class Recording(EventSink):
        def put(self, event) -> None:
            seen.append((type(event).__name__, cache.stats.snapshots_created))
            super().put(event)

    loop = asyncio.new_event_loop()
    prompt = tokenizer.encode("A prompt whose end and answer go into the cache " * 3)
    job = Job(prompt, _Greedy(4), Recording(loop))
    scheduler = Scheduler(model, ServerMetrics(), max_batch=2, max_queue=2, cache=cache)
    scheduler.submit(job)
    scheduler.start()
    try:
        for _ in range(3000):  # a bound, not a timing assertion
            if job.logic.finish_reason is not None and cache.stats.snapshots_created == 2:
                break
            time.sleep(0.01)
    finally:
        scheduler.stop()
        loop.close()
    pieces = [created for kind, created in seen if kind == PieceEvent.__name__]
    assert pieces[0] == 0 and [created for kind, created in seen if kind == FinishEvent.__name__] == [1]
    assert cache.stats.snapshots_created == 2
    answered = prompt + job.generated[:-1]
    for tokens in (prompt + [7], answered + [7]):
        got = cache.prefill(tokens)
        assert got.reused == len(tokens) - 1
        assert torch.equal(got.logits, model.prefill_last(model.new_state(), tokens))
    cache.close()


def test_the_running_streams_step_while_a_snapshot_is_read_from_disk(model, tokenizer, tmp_path):
    """A request whose prompt's snapshot only a file holds has it read on the cache reader's thread:
    the running stream takes decode steps meanwhile (here the read waits until this test writes to
    the file, a FIFO, so the order holds whatever the disk's speed)."""
    import asyncio
    import os
    import time

    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, Scheduler

    prompt = tokenizer.encode("A conversation resumed from its file " * 3)
    writer = PromptCache(model, "reading", 64 * MIB, tmp_path, 1 << 30)
    writer.prefill(prompt)
    writer.close()
    cache = PromptCache(model, "reading", 64 * MIB, tmp_path, 1 << 30)  # a restart: the file alone
    [path] = cache.disk_dir.glob("*.k3snap")
    path.unlink()
    os.mkfifo(path)  # opening it to read waits for a writer: this test, below
    loop = asyncio.new_event_loop()
    running = Job(tokenizer.encode("a stream"), _Greedy(1 << 20), EventSink(loop))
    resumed = Job(prompt + tokenizer.encode(" and on"), _Greedy(2), EventSink(loop))
    scheduler = Scheduler(model, ServerMetrics(), max_batch=2, max_queue=2, cache=cache)

    def until(condition) -> None:
        for _ in range(3000):  # a bound, not a timing assertion
            if condition():
                return
            time.sleep(0.01)

    scheduler.submit(running)
    scheduler.start()
    try:
        until(lambda: running.generated)
        scheduler.submit(resumed)
        until(lambda: resumed.prefill_started_at > 0)
        before = len(running.generated)
        until(lambda: len(running.generated) >= before + 20)
        stepped = len(running.generated) - before
        os.close(os.open(path, os.O_WRONLY))  # the read goes on: an empty file, a miss
        until(lambda: resumed.logic.finish_reason is not None)
    finally:
        running.cancel()
        scheduler.stop()
        loop.close()
        cache.close()
    assert stepped >= 20
    assert resumed.logic.finish_reason == "length" and resumed.cached_tokens == 0


class _GatedPasses:
    """The served model with its prefill passes held at a gate: the test lets them through one by one
    (`release`) or all (`open`), so requests arrive at known points of another's prefill. `rows`: each
    pass's prompt rows."""

    def __init__(self, model) -> None:
        import threading

        self.model, self.entered, self.allowed, self.opened = model, 0, 0, False
        self.rows: list[int] = []
        self.changed = threading.Condition()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill_last(self, state, tokens):
        self._through(len(tokens))
        return self.model.prefill_last(state, tokens)

    def prefill_batch(self, states, token_lists):
        self._through(sum(map(len, token_lists)))
        return self.model.prefill_batch(states, token_lists)

    def _through(self, rows: int) -> None:
        with self.changed:
            self.rows.append(rows)
            self.entered += 1
            number = self.entered
            self.changed.notify_all()
            assert self.changed.wait_for(lambda: self.opened or number <= self.allowed, 60), "gate shut"

    def release(self) -> None:
        """Let the next pass through."""
        with self.changed:
            self.allowed += 1
            self.changed.notify_all()

    def wait_entered(self, count: int) -> None:
        """Wait until `count` passes came to the gate."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.entered >= count, 60), "no pass came"

    def open(self) -> None:
        with self.changed:
            self.opened = True
            self.changed.notify_all()


def _shared_prompts(count: int, shared: int) -> list[list[int]]:
    """`count` prompts of token ids that share their first `shared` and part at the next one."""
    generator = torch.Generator().manual_seed(36)
    prefix = torch.randint(10, 500, (shared,), generator=generator).tolist()
    return [prefix + [500 + i] + torch.randint(10, 500, (20 + 9 * i,), generator=generator).tolist()
            for i in range(count)]  # fmt: skip


def _shared_server(model_path):
    """An in-process server on 127.0.0.1 over the tiny model with a prompt cache that snapshots only
    prompts' and answers' ends, its prefill passes at a gate (`_GatedPasses`), 16-token chunks."""
    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.runtime import served_from_runtime

    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    served.prompt_cache = PromptCache(served.model, "shared", 64 * MIB, every=1 << 20)
    gate = served.model = _GatedPasses(served.model)
    return served, gate, create_app(served, ServerConfig(max_batch=4, prefill_chunk=16))


def _complete(url: str, prompt: list[int], **extra) -> dict:
    import httpx

    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _answer(reply: dict) -> tuple[str, list[float]]:
    choice = reply["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_concurrent_prompts_sharing_a_prefix_compute_it_once_and_answer_as_each_alone(model_path):
    """Four requests sharing a 200-token prefix no snapshot holds, the others arriving while the first
    one's prefill runs: the first computes the prefix once and snapshots its end, the others wait for
    that snapshot, restore it (cached_tokens, /metrics) and compute their own suffixes only; every
    answer's tokens and logprobs equal the request's alone, computed cold on the same server."""
    from concurrent.futures import ThreadPoolExecutor

    from k3stream.server.live import ServerThread

    shared = 200
    prompts = _shared_prompts(4, shared)
    served, gate, app = _shared_server(model_path)
    scheduler = app.state.scheduler
    try:
        with ServerThread(app) as server, ThreadPoolExecutor(4) as pool:
            first = pool.submit(_complete, server.url, prompts[0])
            gate.release()  # the first request's first chunk
            gate.wait_entered(2)  # its second waits at the gate
            others = [pool.submit(_complete, server.url, prompt) for prompt in prompts[1:]]
            wait_until(lambda: scheduler.snapshot()["waiting"] == 3, "the others queue")
            gate.open()
            replies = [first.result()] + [other.result() for other in others]
            metrics = _metrics(server.url)
            alone = [_complete(server.url, prompt, cache_prompt=False) for prompt in prompts]
    finally:
        served.prompt_cache.close()
        served.close()
    cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in replies]
    assert cached == [0, shared, shared, shared]
    assert scheduler.snapshot()["shared_prefills"] == 3
    assert _sample(metrics, "k3stream_shared_prefills_total") == 3
    computed = len(prompts[0]) + sum(len(prompt) - shared for prompt in prompts[1:])
    assert _sample(metrics, "k3stream_prompt_tokens_total") == computed  # the prefix once
    assert _sample(metrics, "k3stream_prompt_tokens_reused_total") == 3 * shared
    assert [_answer(reply) for reply in replies] == [_answer(reply) for reply in alone]


def test_requests_waiting_for_a_cancelled_prefill_compute_their_prompts_alone(model_path):
    """The request whose prefill others wait for leaves mid-prefill (its client disconnects): they go
    on without it, each computing its whole prompt, and answer as each alone."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from k3stream.server.live import ServerThread

    prompts = _shared_prompts(3, 200)
    served, gate, app = _shared_server(model_path)
    scheduler = app.state.scheduler
    try:
        with ServerThread(app) as server, ThreadPoolExecutor(2) as pool:
            leader = socket.create_connection((server.host, server.port))
            body = json.dumps({"prompt": prompts[0], "max_tokens": 4}).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json"
            leader.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            gate.release()  # the leader's first chunk
            gate.wait_entered(2)  # its second waits at the gate
            others = [pool.submit(_complete, server.url, prompt) for prompt in prompts[1:]]
            wait_until(lambda: scheduler.snapshot()["waiting"] == 2, "the others queue")
            gate.release()  # the leader's second chunk; the others, admitted, wait for its prefix
            wait_until(lambda: scheduler.snapshot()["shared_prefills"] == 2, "the others wait for the leader")
            leader.close()  # during its third chunk
            wait_until(lambda: not _leader_active(scheduler), "the server sees the leader go")
            gate.open()
            replies = [other.result() for other in others]
            alone = [_complete(server.url, prompt, cache_prompt=False) for prompt in prompts[1:]]
    finally:
        served.prompt_cache.close()
        served.close()
    assert [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in replies] == [0, 0]
    assert [_answer(reply) for reply in replies] == [_answer(reply) for reply in alone]


def _leader_active(scheduler) -> bool:
    """Whether a request whose prefill runs is active (not cancelled)."""
    return any(job.prefill is not None for job in scheduler.active_jobs())


def test_a_queued_request_restores_the_prefix_a_running_prefill_shared_with_it(model, tokenizer):
    """Requests beyond the batch's one slot that share a prefix with the prefill that starts once the
    slot frees (another request decodes in it meanwhile) have it snapshotted there: each restores it
    when its turn comes and computes its own suffix, answering as alone."""
    shared = 200
    prompts = [tokenizer.encode("a request in the slot first")] + _shared_prompts(3, shared)
    cache = PromptCache(model, "queued", 64 * MIB, every=1 << 20)  # snapshots at prompts' ends only
    try:
        _, jobs = _run_together(model, tokenizer, cache, prompts, max_batch=1, max_queue=4, prefill_chunk=64)
    finally:
        cache.close()
    assert [job.cached_tokens for job in jobs] == [0, 0, shared, shared]
    computed = sum(map(len, prompts[:2])) + sum(len(ids) - shared for ids in prompts[2:])
    assert cache.stats.tokens_computed == computed
    _assert_each_answers_as_alone(jobs, prompts, model, tokenizer)


def test_a_prompt_that_branches_off_a_cached_one_is_snapshotted_where_it_branches(model, tokenizer):
    """One request after another sharing a prefix: the second, whose prompt branches off the first's
    (cached at its end only) 200 tokens in, is snapshotted there, and the third restores that."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, Scheduler

    shared = 200
    prompts = _shared_prompts(3, shared)
    cache = PromptCache(model, "branch", 64 * MIB, every=1 << 20)  # snapshots at prompts' ends only
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(model, ServerMetrics(), max_batch=1, max_queue=1, cache=cache, prefill_chunk=64)
    scheduler.start()
    jobs = []
    try:
        for ids in prompts:
            jobs.append(Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)))
            scheduler.submit(jobs[-1])
            wait_until(lambda: jobs[-1].logic.finish_reason is not None, "the request finishes")
    finally:
        scheduler.stop()
        loop.close()
        cache.close()
    _assert_third_restored_the_prefix(jobs, prompts, cache, shared, model, tokenizer)


def test_a_request_too_late_to_wait_for_a_running_prefill_is_snapshotted_where_it_branches(model, tokenizer):
    """A request that arrives after a running prefill has passed the prefix they share computes it
    itself (the state there is gone), and is snapshotted where its prompt branches off the running
    one: a third request restores the prefix instead of computing it again."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, Scheduler

    shared = 200
    generator = torch.Generator().manual_seed(37)
    prefix = torch.randint(10, 500, (shared,), generator=generator).tolist()
    tails = [200, 30, 30]  # the first's prefill runs on well past the prefix
    prompts = [
        prefix + [500 + i] + torch.randint(10, 500, (tail,), generator=generator).tolist()
        for i, tail in enumerate(tails)
    ]
    cache = PromptCache(model, "late", 64 * MIB, every=1 << 20)  # snapshots at prompts' ends only
    gate = _GatedPasses(model)
    loop = asyncio.new_event_loop()
    jobs = [Job(ids, Sequence(tokenizer, ids, GREEDY), EventSink(loop)) for ids in prompts]
    scheduler = Scheduler(gate, ServerMetrics(), max_batch=2, max_queue=2, cache=cache, prefill_chunk=64)
    scheduler.submit(jobs[0])
    scheduler.start()
    try:
        gate.wait_entered(1)
        while jobs[0].prompt_done <= shared:  # the first's passes, one at a time, past the prefix
            gate.release()
            gate.wait_entered(gate.entered + 1)
        assert jobs[0].prompt_done < len(prompts[0])  # its prefill runs, its end not cached
        scheduler.submit(jobs[1])
        gate.open()
        wait_until(lambda: all(job.logic.finish_reason is not None for job in jobs[:2]), "both finish")
        scheduler.submit(jobs[2])
        wait_until(lambda: jobs[2].logic.finish_reason is not None, "the third finishes")
    finally:
        gate.open()
        scheduler.stop()
        loop.close()
        cache.close()
    _assert_third_restored_the_prefix(jobs, prompts, cache, shared, model, tokenizer)


def test_a_request_waits_only_for_a_prefix_that_pays_beyond_the_cache(model, tokenizer):
    """No request waits where the shared part beyond the deepest snapshot is short of `share_tokens`:
    a short common prefix, or a long one a snapshot already holds but for a few tokens."""
    from k3stream.server.scheduler import DEFAULT_SHARE_TOKENS

    short = _shared_prompts(2, DEFAULT_SHARE_TOKENS - 8)
    held = _shared_prompts(2, 300)
    for prompts, snapshot in ((short, 0), (held, 300 - DEFAULT_SHARE_TOKENS + 8)):
        cache = PromptCache(model, "threshold", 64 * MIB, every=1 << 20)
        if snapshot:
            cache.prefill(prompts[0][:snapshot])
        try:
            scheduler, jobs = _run_together(
                model, tokenizer, cache, prompts, max_batch=2, max_queue=2, prefill_chunk=16
            )
        finally:
            cache.close()
        assert scheduler.snapshot()["shared_prefills"] == 0
        assert [job.cached_tokens for job in jobs] == [snapshot, snapshot]


def test_without_a_prompt_cache_no_request_waits_for_another(model_path):
    """With `--cache-ram 0` (no cache) concurrent requests sharing a prefix each compute it."""
    from concurrent.futures import ThreadPoolExecutor

    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread
    from k3stream.server.runtime import served_from_runtime

    prompts = _shared_prompts(3, 200)
    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=512)
    app = create_app(served, ServerConfig(max_batch=4, prefill_chunk=16))
    try:
        with ServerThread(app) as server, ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda prompt: _complete(server.url, prompt), prompts))
            metrics = _metrics(server.url)
    finally:
        served.close()
    assert app.state.scheduler.share_tokens == 0
    assert app.state.scheduler.snapshot()["shared_prefills"] == 0
    assert _sample(metrics, "k3stream_prompt_tokens_total") == sum(map(len, prompts))
    assert all(reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for reply in replies)


def test_a_server_restores_a_snapshot_another_process_wrote_into_its_folder_after_it_started(
    model, model_path, tmp_path
):
    """Two servers of one model on one --cache-dir share their sessions: a snapshot file the other one
    writes after this one started is restored here (the request computes no prompt token and answers as
    the prompt computed whole), and this server never deletes the other's file."""
    from k3stream.engine.loading import load_runtime
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread
    from k3stream.server.runtime import served_from_runtime

    fingerprint = model_fingerprint(K3Checkpoint.open(model_path).shards)
    served = served_from_runtime(load_runtime(model_path, stream_experts=False), ctx=256)
    served.prompt_cache = PromptCache(served.model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    prompt = served.encode_prompt("A conversation another server of this model began")
    with ServerThread(create_app(served, ServerConfig())) as thread:
        other = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)  # the other server's cache
        other.prefill(prompt)
        other.close()  # its file written
        (written,) = other.disk_dir.glob("*.k3snap")
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
        fields = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        restored = client.completions.create(**fields)
        computed = client.completions.create(**fields, extra_body={"cache_prompt": False})
    served.prompt_cache.close()
    served.close()
    assert restored.usage.prompt_tokens_details.cached_tokens == len(prompt)
    assert restored.choices[0].text == computed.choices[0].text
    assert written.exists()
