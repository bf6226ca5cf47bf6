"""The prompt cache: longest cached prefix restored, the rest prefilled, the cold prompt's bits."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import k3stream
from k3stream.engine.prompt_cache import (
    MIB,
    ChunkedPrefill,
    Entry,
    PrefillChunks,
    PromptCache,
    RadixTree,
    attention_rows_per_token,
    model_fingerprint,
)
from k3stream.gguf.reader import K3Checkpoint
from k3stream.quant.kernels import set_row_exact


@pytest.fixture(scope="module")
def model(model_path, one_torch_thread):
    yield k3stream.load(model_path)
    set_row_exact(False)  # what a cache turned on


@pytest.fixture(scope="module")
def fingerprint(model_path) -> str:
    return model_fingerprint(K3Checkpoint.open(model_path).shards)


def ids(model, length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()


def cold(model, tokens: list[int]) -> torch.Tensor:
    return model.prefill_last(model.new_state(), tokens)


def test_the_radix_tree_finds_the_deepest_stored_prefix_and_splits_branches():
    tree = RadixTree()
    for tokens in ((1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (1, 2, 9), (7,)):
        tree.insert(Entry(tokens))
    assert tree.deepest([1, 2, 3, 4, 5, 6, 7], 7).tokens == (1, 2, 3, 4, 5, 6)
    assert tree.deepest([1, 2, 3, 4, 5, 6, 7], 5).tokens == (1, 2, 3, 4)  # clamped
    assert tree.deepest([1, 2, 9, 9], 4).tokens == (1, 2, 9)
    assert tree.deepest([1, 2, 3], 3) is None and tree.deepest([8], 1) is None
    tree.remove((1, 2, 3, 4, 5, 6))
    tree.remove((1, 2, 3, 4, 5, 6))  # gone already: nothing
    tree.remove((1, 2, 8))
    assert tree.deepest([1, 2, 3, 4, 5, 6], 6).tokens == (1, 2, 3, 4)
    assert sorted(entry.tokens for entry in tree.entries()) == [(1, 2, 3, 4), (1, 2, 9), (7,)]


def test_a_second_turn_computes_only_its_new_tokens_with_the_cold_bits(model, fingerprint):
    cache = PromptCache(model, fingerprint, ram_bytes=64 * MIB, every=16)
    first = ids(model, 50)
    got = cache.prefill(first)
    assert got.reused == 0 and torch.equal(got.logits, cold(model, first))
    answer = [int(got.logits.argmax())]
    for _ in range(5):
        answer.append(int(model.decode(got.state, answer[-1]).argmax()))
    cache.save(first + answer[:-1], got.state)  # the end of the response: every token but the last
    second = first + answer + ids(model, 20, seed=1)
    again = cache.prefill(second)
    assert again.reused == len(first) + len(answer) - 1
    assert torch.equal(again.logits, cold(model, second))
    assert cache.stats.tokens_computed == len(first) + len(second) - again.reused
    repeated = cache.prefill(second)  # a prompt seen whole: its state and its kept logits
    assert repeated.reused == len(second) and torch.equal(repeated.logits, again.logits)
    assert cache.stats.tokens_computed == len(first) + len(second) - again.reused
    branch = first[:40] + ids(model, 10, seed=2)  # an edited turn: the snapshot at 32 serves it
    assert cache.prefill(branch).reused == 32
    assert torch.equal(cache.prefill(branch).logits, cold(model, branch))


def test_the_ram_budget_evicts_and_holds(model, fingerprint):
    probe = PromptCache(model, fingerprint, ram_bytes=64 * MIB, every=1 << 20)
    probe.prefill(ids(model, 30))
    one = probe.ram_bytes
    cache = PromptCache(model, fingerprint, ram_bytes=int(2.5 * one), every=1 << 20)
    for seed in range(5):
        cache.prefill(ids(model, 30, seed=seed))
        assert cache.ram_bytes <= cache.ram_budget
    assert cache.stats.evictions_ram == 3
    assert cache.prefill(ids(model, 30, seed=4) + [1]).reused == 30  # the recent ones stay


def test_a_restarted_cache_resumes_from_disk_and_a_bad_file_is_a_miss(model, fingerprint, tmp_path, caplog):
    tokens = ids(model, 40)
    first = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    first.prefill(tokens)
    first.close()  # its files written
    longer = tokens + ids(model, 7, seed=3)
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    got = restarted.prefill(longer)
    restarted.flush()
    assert got.reused == 40 and torch.equal(got.logits, cold(model, longer))
    other_model = PromptCache(model, "0" * 16, 64 * MIB, tmp_path, 1 << 30)
    assert other_model.prefill(longer).reused == 0
    for number, path in enumerate(sorted((tmp_path / fingerprint).iterdir())):
        data = path.read_bytes()  # one file a bit flipped, the other cut short
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:] if number == 0 else data[:-9])
    corrupt = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    longest = longer + [5]  # both files hold prefixes of it: each is tried, and each is a miss
    with caplog.at_level(logging.WARNING):
        got = corrupt.prefill(longest)
    assert caplog.text.count("checksum mismatch") == 2 and corrupt.stats.disk_errors == 2
    assert got.reused == 0 and torch.equal(got.logits, cold(model, longest))


def test_concurrent_requests_share_a_prefix_while_one_extends_it(model, fingerprint):
    cache = PromptCache(model, fingerprint, 64 * MIB, every=8)
    system = ids(model, 24)
    cache.prefill(system)
    prompts = [system + ids(model, 6 + i, seed=10 + i) for i in range(4)]
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        results[i] = cache.prefill(prompts[i]).logits

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, tokens in enumerate(prompts):
        assert torch.equal(results[i], cold(model, tokens))
    assert cache.stats.hits >= 4


def test_a_ram_budget_smaller_than_a_snapshot_still_fills_the_disk_tier(model, fingerprint, tmp_path):
    tokens = ids(model, 30)
    cache = PromptCache(model, fingerprint, ram_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 30)
    cache.prefill(tokens)
    cache.flush()
    assert cache.ram_bytes == 0 and cache.stats.evictions_ram == 1
    assert cache.counts() == {"ram_snapshots": 0, "disk_snapshots": 1}
    got = cache.prefill(tokens + [3])  # read back from disk
    assert got.reused == 30 and torch.equal(got.logits, cold(model, tokens + [3]))


def test_chunks_cut_at_fixed_positions_each_about_the_work_of_the_first(model):
    """Deep in a long prompt a token attends over more rows: its chunks take fewer tokens, each as much
    work as the prompt's first chunk (within one token), cut where they are whatever position a
    restored prefill starts from."""
    chunks, length = PrefillChunks(64, attention_rows_per_token(model.config)), 4096
    ends = [chunks.next_end(0, length)]
    while ends[-1] < length:
        ends.append(chunks.next_end(ends[-1], length))
    starts = [0, *ends[:-1]]
    assert ends[0] == 64
    for start, end in zip(starts[:-1], ends[:-1], strict=True):  # the last is cut by the prompt's end
        assert chunks.cost(start, end) <= chunks.budget < chunks.cost(start, end + 1)
        assert chunks.next_end((start + end) // 2, length) == end
    assert ends[-2] - starts[-2] < 32  # at ~4K positions the attention outweighs the rest
    assert PrefillChunks(64).next_end(100, length) == 128  # without attention rows: every 64 tokens


def test_a_prefill_in_chunks_of_equal_work_has_the_whole_prefills_bits(model, fingerprint):
    cache = PromptCache(model, fingerprint, ram_bytes=64 * MIB, every=40)
    tokens = ids(model, 300, seed=3)
    chunks = PrefillChunks(48, attention_rows_per_token(model.config) / 16)  # shrinking within 300
    prefill, steps = ChunkedPrefill(model, tokens, cache), 1
    while not prefill.step(chunks):
        steps += 1
    assert steps > 300 // 48 + 1
    assert torch.equal(prefill.logits, cold(model, tokens))
    restored = cache.prefill(tokens[:250] + ids(model, 30, seed=4))  # from the snapshot at 240
    assert restored.reused == 240
    cache.close()
