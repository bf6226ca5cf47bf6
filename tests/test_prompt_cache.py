"""The prompt cache: longest cached prefix restored, the rest prefilled, the cold prompt's bits."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import k3stream
from k3stream.engine.cache_folders import TEMPORARY_GRACE, FolderLock, _unheld
from k3stream.engine.chunked_prefill import ChunkedPrefill, PrefillChunks, attention_rows_per_token
from k3stream.engine.fingerprints import model_fingerprint
from k3stream.engine.prompt_cache import Entry, PromptCache
from k3stream.engine.radix import RadixTree, common_length
from k3stream.engine.snapshot_files import MAGIC, SUFFIX, decode, encode, file_name, read_header
from k3stream.gguf.reader import K3Checkpoint
from k3stream.memlimit import MIB
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


def test_the_common_prefix_length_of_token_ids_is_where_they_first_differ():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        a = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 40)))
        b = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 40)))
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_length(a, b) == first


def test_where_token_ids_branch_off_the_tree_is_their_longest_common_prefix_with_an_entry():
    import random

    rng = random.Random(1)
    for _ in range(300):
        tree, stored = RadixTree(), []
        for _ in range(rng.randint(0, 6)):
            stored.append(tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 12))))
            tree.insert(Entry(stored[-1]))
        probe = [rng.randint(0, 2) for _ in range(rng.randint(0, 14))]
        expected = max((common_length(tokens, tuple(probe)) for tokens in stored), default=0)
        assert tree.shared_length(probe) == expected


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
    for number, path in enumerate(sorted(restarted.disk_dir.iterdir())):
        data = path.read_bytes()  # one file a bit flipped, the other cut short
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:] if number == 0 else data[:-9])
    corrupt = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    longest = longer + [5]  # both files hold prefixes of it: each is tried, and each is a miss
    with caplog.at_level(logging.WARNING):
        got = corrupt.prefill(longest)
    assert caplog.text.count("checksum mismatch") == 2 and corrupt.stats.disk_errors == 2
    assert got.reused == 0 and torch.equal(got.logits, cold(model, longest))


def _rewrite_header(path: Path, change) -> None:
    """`path`'s header replaced by `change(header)` (its checksum left as it was)."""
    data = path.read_bytes()
    start = len(MAGIC) + 8
    (length,) = struct.unpack("<Q", data[len(MAGIC) : start])
    header = json.dumps(change(json.loads(data[start : start + length]))).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(header)) + header + data[start + length :])


@pytest.mark.parametrize("damage", ["layer-without-shape", "tokens-not-integers", "swapped"])
def test_a_restart_over_files_with_damaged_headers_or_names_is_a_miss(model, fingerprint, tmp_path, damage):
    """The start reads each file's header alone: a layer without its shape or token ids that are not
    integers in a header, or two files swapped (each holding the other's ids), are skipped with a
    warning, never a failed start; a prompt the swapped files held is computed cold."""
    first = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30, every=1 << 20)
    prompts = [ids(model, 30, seed=seed) for seed in (1, 2)]
    for prompt in prompts:
        first.prefill(prompt)
    first.close()
    files = sorted(first.disk_dir.iterdir())
    if damage == "swapped":
        one, two = (path.read_bytes() for path in files)
        files[0].write_bytes(two)
        files[1].write_bytes(one)
    else:
        field, value = ("layers", [["mla"]]) if damage == "layer-without-shape" else ("tokens", [[1], [2]])
        for path in files:
            _rewrite_header(path, lambda header: {**header, field: value})
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30, every=1 << 20)
    assert restarted.stats.disk_errors == 2 and restarted.counts()["disk_snapshots"] == 0
    longer = prompts[0] + [7]
    got = restarted.prefill(longer)
    assert got.reused == 0 and torch.equal(got.logits, cold(model, longer))
    restarted.close()


def test_a_cache_folder_serves_only_the_arithmetic_that_wrote_it(tiny_model, tmp_path):
    """Snapshots are keyed to how the model computes too: a server restarted on the same folder with
    other arithmetic flags (here float32 activations on a quantized file) reuses none of them and answers
    with its own cold bits; the same flags reuse them."""
    from k3stream.model.options import LoadOptions

    quantized = tiny_model(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
    loaded = {ggml: k3stream.load(quantized, LoadOptions(match_ggml=ggml)) for ggml in (True, False)}
    key = model_fingerprint(K3Checkpoint.open(quantized).shards)
    tokens = ids(loaded[True], 40)
    writer = PromptCache(loaded[True], key, 64 * MIB, tmp_path / "cache", 1 << 30)
    writer.prefill(tokens)
    writer.close()
    longer = tokens + ids(loaded[True], 5, seed=2)
    other = PromptCache(loaded[False], key, 64 * MIB, tmp_path / "cache", 1 << 30)
    got = other.prefill(longer)
    assert got.reused == 0 and torch.equal(got.logits, cold(loaded[False], longer))
    assert not torch.equal(got.logits, cold(loaded[True], longer))  # the two arithmetics' bits differ
    same = PromptCache(loaded[True], key, 64 * MIB, tmp_path / "cache", 1 << 30)
    assert same.prefill(longer).reused == 40
    for cache in (other, same):
        cache.close()


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


def conversation(model, cache: PromptCache, turns: int, seed: int = 0) -> list[list[int]]:
    """`turns` turns of a conversation (a prompt, a 4-token answer, the next prompt extends both): the
    prompts."""
    prompts, context = [], ids(model, 30, seed)
    for turn in range(turns):
        got = cache.prefill(context)
        answer = [int(got.logits.argmax())]
        for _ in range(3):
            answer.append(int(model.decode(got.state, answer[-1]).argmax()))
        cache.save(context + answer[:-1], got.state)
        prompts.append(context)
        context = context + answer + ids(model, 12, seed=20 + turn)
    cache.flush()
    return prompts


def headers(directory) -> dict[int, dict]:
    found = [read_header(path, path.parent.name) for path in directory.iterdir()]
    return {len(header["tokens"]): header for header in found}


def test_snapshot_files_of_a_conversation_share_its_latent_rows(model, fingerprint, tmp_path):
    """Each file holds only the latent rows past its parent (the deepest file of a prefix of its
    tokens): three turns' six files hold each latent row once, not once per file."""
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    conversation(model, cache, 3)
    found = headers(cache.disk_dir)
    lengths = sorted(found)
    assert len(lengths) == 6 and "parent" not in found[lengths[0]]
    for shorter, longer in zip(lengths, lengths[1:], strict=False):
        assert found[longer]["parent"][0] == shorter
        mla = [layer for layer in found[longer]["layers"] if layer[0] == "mla"]
        assert mla and all(layer[1][0] == longer - shorter for layer in mla)
    whole = PromptCache(model, fingerprint, 64 * MIB)  # each snapshot's file as if it stood alone
    conversation(model, whole, 3)
    alone = {
        e.length: sum(map(len, encode(fingerprint, e.tokens, e.snapshot))) for e in whole._tree.entries()
    }
    row_bytes = sum(4 * layer[1][1] for layer in found[lengths[0]]["layers"] if layer[0] == "mla")
    shared = sum(row_bytes * found[length]["parent"][0] for length in lengths[1:])  # rows not repeated
    assert abs(sum(alone[length] for length in lengths) - shared - cache.disk_used) < 64 * len(lengths)
    cache.close()
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)  # RAM empty: the chain
    longest = lengths[-1]
    prompt = next(e.tokens for e in whole._tree.entries() if e.length == longest) + (7, 8)
    got = restarted.prefill(list(prompt))
    assert got.reused == longest and torch.equal(got.logits, cold(model, list(prompt)))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_parent_makes_its_children_misses(model, fingerprint, tmp_path, caplog, damage):
    """The second of three turns' files damaged (a byte flipped, cut short, deleted): the snapshots
    chained through it are misses with a warning; the first turn's still serves; the answer is cold."""
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    prompts = conversation(model, cache, 3)
    cache.close()
    directory = cache.disk_dir
    files = {len(h["tokens"]): directory / file_name(tuple(h["tokens"])) for h in headers(directory).values()}
    middle = files[len(prompts[1])]  # the second prompt's end: the files after it chain through it
    data = middle.read_bytes()
    if damage == "flip":
        middle.write_bytes(data[:200] + bytes([data[200] ^ 4]) + data[201:])
    elif damage == "truncate":
        middle.write_bytes(data[: len(data) // 2])
    else:
        middle.unlink()
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    prompt = prompts[2] + [9, 9]
    with caplog.at_level(logging.WARNING):
        got = restarted.prefill(prompt)
    assert torch.equal(got.logits, cold(model, prompt))
    first_turn = sorted(length for length in files if length < len(prompts[1]))[-1]
    assert got.reused == first_turn  # the response end of turn 1: before the damage
    assert f"its parent snapshot of {len(prompts[1])} tokens" in caplog.text
    assert restarted.stats.disk_errors >= 1


def _snapshot_parts(path: Path) -> tuple[dict, list[np.ndarray]]:
    """A snapshot file's header and its tensors, as the header lays them out."""
    data = path.read_bytes()
    start = len(MAGIC) + 8
    (length,) = struct.unpack("<Q", data[len(MAGIC) : start])
    header, offset, tensors = json.loads(data[start : start + length]), start + length, []
    for _kind, *shapes in header["layers"]:
        for shape in shapes:
            count = math.prod(shape)
            tensors.append(np.frombuffer(data, np.float32, count, offset).reshape(shape))
            offset += 4 * count
    return header, tensors


def _write_snapshot(path: Path, header: dict, tensors: list[np.ndarray]) -> int:
    """A snapshot file of `header` and `tensors` with a valid checksum, which it returns."""
    encoded = json.dumps(header).encode()
    body = MAGIC + struct.pack("<Q", len(encoded)) + encoded + b"".join(t.tobytes() for t in tensors)
    checksum = xxhash.xxh3_64_intdigest(body)
    path.write_bytes(body + struct.pack("<Q", checksum))
    return checksum


def _unchanged(header: dict, tensors: list[np.ndarray]) -> None:
    pass


def _rewritten(source: Path, target: Path, fingerprint: str, change=_unchanged) -> list[Path]:
    """The snapshot files of `source` written into `target` under this `fingerprint` (its cache's
    folder), each changed by `change(header, tensors)` (in place), parents first, every checksum valid
    and each child naming its parent's new one."""
    found = sorted(
        (_snapshot_parts(path) for path in source.iterdir()), key=lambda part: len(part[0]["tokens"])
    )
    identities: dict[int, int] = {}
    written = []
    for header, tensors in found:
        tensors = list(tensors)
        header["fingerprint"] = fingerprint
        if "parent" in header:
            header["parent"][1] = identities[header["parent"][0]]
        change(header, tensors)
        written.append(target / file_name(tuple(header["tokens"])))
        identities[len(header["tokens"])] = _write_snapshot(written[-1], header, tensors)
    return written


def _widen_latents(header: dict, tensors: list[np.ndarray]) -> None:
    """Every MLA layer's rows one float wider (the first file's only: its child keeps the width)."""
    if "parent" in header:
        return
    index = 0
    for layer in header["layers"]:
        if layer[0] == "mla":
            layer[1][1] += 1
            tensors[index] = np.pad(tensors[index], ((0, 0), (0, 1)))
        index += len(layer) - 1


def _empty_latent_shape(header: dict, tensors: list[np.ndarray]) -> None:
    """The first MLA layer's shape [] (one value, as such a shape holds) in the first file."""
    if "parent" in header:
        return
    index = 0
    for layer in header["layers"]:
        if layer[0] == "mla":
            layer[1] = []
            tensors[index] = np.zeros((), np.float32)
            return
        index += len(layer) - 1


def _longer_logits(header: dict, tensors: list[np.ndarray]) -> None:
    header["layers"][-1][1][0] += 1
    tensors[-1] = np.append(tensors[-1], np.float32(9.0))


FOREIGN_DIMENSIONS = {
    "latent-width": {"kv_lora": 48},
    "kda-head-width": {"kda_head_dim": 8},
    "layer-count": {"n_layers": 8},
    "vocabulary": {"vocab": 700},
}
HAND_EDITS = {"latent-width-in-a-parent": _widen_latents, "empty-latent-shape": _empty_latent_shape,
              "logits-width": _longer_logits}  # fmt: skip


@pytest.mark.parametrize("case", [*FOREIGN_DIMENSIONS, *HAND_EDITS])
def test_snapshot_files_of_other_widths_with_valid_checksums_are_misses(
    model, fingerprint, tiny_model, tmp_path, caplog, case
):
    """Real snapshot files (a prompt, and a longer one chained to it) of a model of other dimensions, or
    this model's with their header and tensors edited, rewritten into this model's folder with valid
    checksums: each restore is a miss with a one-line warning naming the file and the header field,
    the answer the cold one; never a failed request or another model's state."""
    writer_model = (
        k3stream.load(tiny_model(**FOREIGN_DIMENSIONS[case])) if case in FOREIGN_DIMENSIONS else model
    )
    first = ids(model, 30)
    second = first + ids(model, 12, seed=1)
    writer = PromptCache(writer_model, "f" * 16, 64 * MIB, tmp_path / "writer", 1 << 30, every=1 << 20)
    for prompt in (first, second):
        writer.prefill(prompt)
    writer.close()
    ours = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "ours", 1 << 30)
    ours.close()  # its folder
    files = _rewritten(writer.disk_dir, ours.disk_dir, ours.fingerprint, HAND_EDITS.get(case, _unchanged))
    with caplog.at_level(logging.WARNING):
        restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "ours", 1 << 30, every=1 << 20)
        for prompt in (second + [3], second, first):  # deepest first: each restore would take a file
            got = restarted.prefill(prompt)
            assert got.reused == 0 and torch.equal(got.logits, cold(model, prompt)), prompt
    restarted.close()
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert all("\n" not in warning for warning in warnings)
    named = [path for path in files if any(path.name in w and "header field layers" in w for w in warnings)]
    assert files[0] in named, warnings  # the first file is changed in every case


def test_a_temporary_file_is_removed_once_left_unwritten_for_the_grace(
    model, fingerprint, tmp_path, monkeypatch
):
    """A process killed between writing a snapshot and renaming it leaves the temp file under the name
    the writer gave it: a start on the directory removes it once nothing wrote it for TEMPORARY_GRACE
    seconds, and leaves a younger one (another process with this key may be writing it)."""
    temporaries: list[Path] = []
    rename = os.replace

    def recorded(source, target):
        temporaries.append(Path(source))
        rename(source, target)

    monkeypatch.setattr(os, "replace", recorded)
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    cache.prefill(ids(model, 25, seed=7))
    cache.close()
    monkeypatch.undo()
    assert temporaries and not any(path.exists() for path in temporaries)
    left = temporaries[0]
    left.write_bytes(b"half a snapshot")  # what a writer leaves, in flight or killed
    young = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    young.close()
    assert left.exists() and young.stats.removed.temporaries == 0
    age(left, TEMPORARY_GRACE + 1)
    stale = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30)
    stale.close()
    assert not left.exists() and stale.stats.removed.temporaries == 1
    assert stale.stats.removed.temporary_bytes == len(b"half a snapshot")


def age(path: Path, seconds: float) -> None:
    """Set `path`'s times `seconds` in the past."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def foreign_files(model, directory: Path, fingerprint: str, seeds: list[int]) -> list[Path]:
    """One snapshot file per seed in `directory`'s folder of `fingerprint` (another model file's: a
    foreign folder to a cache of the test model), the first the oldest."""
    writer = PromptCache(model, fingerprint, 64 * MIB, directory, 1 << 30, every=1 << 20)
    prompts = [ids(model, 30, seed=seed) for seed in seeds]
    for prompt in prompts:
        writer.prefill(prompt)
    writer.close()
    files = [writer.disk_dir / file_name(tuple(prompt)) for prompt in prompts]
    for number, path in enumerate(files):
        age(path, 1000 - number)
    return files


def test_the_disk_budget_covers_other_keys_folders_and_takes_their_oldest_first(model, fingerprint, tmp_path):
    """`--cache-disk` bounds every snapshot folder of the directory: within it another key's folder stays
    whole; over it its snapshots go first, oldest first, before any of this key's own, and a folder
    emptied goes too. What is not ours (other names) stays and is not counted. A start over the budget
    trims the directory before it serves."""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30, every=1 << 20)
    probe.prefill(ids(model, 40, seed=70))
    probe.close()
    directory = tmp_path / "states"
    oldest = foreign_files(model, directory, "1" * 16, [60])  # a folder of its own, the oldest file
    older, newest = foreign_files(model, directory, "0" * 16, [61, 62])
    foreign = [*oldest, older, newest]
    ours_not = [directory / "notes.txt", newest.parent / "README", directory / "elsewhere" / oldest[0].name]
    for path in ours_not:  # one named as a snapshot, outside a folder of our naming
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"not k3stream's" * 1000)
    sizes = [path.stat().st_size for path in foreign]
    roomy = PromptCache(model, fingerprint, 64 * MIB, directory, probe.disk_used + sum(sizes), every=1 << 20)
    roomy.prefill(ids(model, 40, seed=70))
    roomy.close()
    assert roomy.disk_used == probe.disk_used and all(path.exists() for path in foreign)
    assert roomy.stats.foreign.nbytes == sum(sizes) and roomy.stats.foreign.folders == 2
    assert roomy.stats.removed.snapshots == roomy.stats.evictions_disk == 0
    budget = probe.disk_used + sizes[-1]  # room for this key's file and the newest foreign one
    tight = PromptCache(model, fingerprint, 64 * MIB, directory, budget, every=1 << 20)
    assert [path.exists() for path in foreign] == [False, False, True]  # at its start, oldest first
    assert not oldest[0].parent.exists()  # emptied: removed
    assert tight.stats.removed.snapshots == 2 and tight.stats.removed.snapshot_bytes == sum(sizes[:2])
    assert tight.stats.removed.folders == 1 and tight.stats.evictions_disk == 0
    assert tight.disk_used == probe.disk_used and tight.stats.foreign.nbytes == sizes[-1]
    assert "removed 2 snapshots of other folders" in tight.disk_line()
    prompt = ids(model, 40, seed=71)
    tight.prefill(prompt)  # a second file of its own: the last foreign one goes first
    tight.flush()
    assert not newest.exists() and tight.stats.foreign.nbytes == 0
    assert tight.disk_used + tight.stats.foreign.nbytes <= budget
    assert newest.parent.exists()  # its README is not ours: the folder stays with it
    assert all(path.exists() for path in ours_not)
    tight.close()
    restarted = PromptCache(model, fingerprint, 64 * MIB, directory, budget)  # open: row-exact products
    got = restarted.prefill(prompt + [1])
    assert got.reused == len(prompt) and torch.equal(got.logits, cold(model, prompt + [1]))
    restarted.close()


HOLD = """import sys
from pathlib import Path
from k3stream.engine.cache_folders import FolderLock
lock = FolderLock(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_folder_another_process_holds_and_a_young_temporary_are_left_alone(model, fingerprint, tmp_path):
    """Two processes on one directory with different keys: while the other one lives (it holds its
    folder), its snapshots stay whatever the budget, and so does a temporary file it may be writing;
    a temporary left unwritten for the grace goes. Once that process is gone (killed: the kernel drops
    its lock), its snapshots go first."""
    directory = tmp_path / "states"
    (snapshot,) = foreign_files(model, directory, "0" * 16, [80])
    folder = snapshot.parent
    writing, left = (folder / f"{file_name((number,))}.tmp4242.1" for number in (1, 2))
    for path in (writing, left):
        path.write_bytes(b"part of a snapshot")
    age(left, TEMPORARY_GRACE + 1)
    environment = {**os.environ, "PYTHONPATH": str(Path(k3stream.__file__).parents[1])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=environment,
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        cache = PromptCache(model, fingerprint, 64 * MIB, directory, 1, every=1 << 20)
        cache.prefill(ids(model, 30, seed=81))
        cache.flush()
        assert snapshot.exists() and writing.exists() and not left.exists()
        assert cache.stats.removed.temporaries == 1 and cache.stats.removed.snapshots == 0
        assert cache.stats.evictions_disk == 1 and cache.disk_used == 0  # its own file went instead
    finally:
        holder.kill()
        holder.wait()
    cache.prefill(ids(model, 30, seed=82))
    cache.flush()
    assert not snapshot.exists() and cache.stats.removed.snapshots == 1
    assert writing.exists() and folder.exists()  # the young temporary keeps its folder
    cache.close()


def test_a_folder_opened_while_another_process_trims_it_away_is_made_again(tmp_path):
    """A cache that opens its folder while a trim holds it (to empty and remove it) waits for the trim,
    and then holds the folder made again, not the one removed: no trim can take it after."""
    folder = tmp_path / f"{'0' * 16}-{'1' * 16}"
    folder.mkdir()
    trimming = _unheld(folder)
    assert trimming is not None
    opened: list[FolderLock] = []
    opening = threading.Thread(target=lambda: opened.append(FolderLock(folder)))
    opening.start()
    opening.join(0.3)
    assert not opened  # waiting for the trim's lock
    folder.rmdir()  # what a trim does to a folder it emptied, then it lets go
    os.close(trimming)
    opening.join(30)
    assert opened and folder.is_dir() and _unheld(folder) is None
    opened[0].release()
    free = _unheld(folder)
    assert free is not None
    os.close(free)


def test_disk_eviction_never_orphans_a_file(model, fingerprint, tmp_path):
    """Under a disk budget of a few files, eviction never takes the rows a file refers to: every file
    left has its parent, and the newest conversation's deepest file still restores with the cold bits."""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    conversation(model, probe, 1)
    budget = 3 * probe.disk_used
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", budget, every=1 << 20)
    for seed in range(3):  # three conversations: the oldest give way
        cache.prefill(ids(model, 25, seed=40 + seed))
        prompts = conversation(model, cache, 3)
    assert cache.stats.evictions_disk > 0 and cache.disk_used <= budget
    found = headers(cache.disk_dir)
    chained = [header["parent"][0] for header in found.values() if "parent" in header]
    assert chained and all(length in found for length in chained)
    cache.close()
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", budget)
    prompt = prompts[-1] + [3]
    got = restarted.prefill(prompt)
    assert got.reused == len(prompts[-1]) and torch.equal(got.logits, cold(model, prompt))


def test_chunks_each_take_about_the_work_of_the_first(model):
    """Deep in a long prompt a token attends over more rows: its chunks take fewer tokens, each as much
    work as the prompt's first chunk (within one token), from wherever a chunk starts."""
    chunks, length = PrefillChunks(64, attention_rows_per_token(model.config)), 4096
    ends = [chunks.next_end(0, length)]
    while ends[-1] < length:
        ends.append(chunks.next_end(ends[-1], length))
    starts = [0, *ends[:-1]]
    assert ends[0] == 64
    for start, end in zip(starts[:-1], ends[:-1], strict=True):  # the last is cut by the prompt's end
        assert chunks.cost(start, end) <= chunks.budget < chunks.cost(start, end + 1)
    assert ends[-2] - starts[-2] < 32  # at ~4K positions the attention outweighs the rest
    middle = chunks.next_end(1000, length)  # a chunk of a prefill restored at 1,000
    assert chunks.cost(1000, middle) <= chunks.budget < chunks.cost(1000, middle + 1)
    assert PrefillChunks(64).next_end(100, length) == 164  # without attention rows: 64 tokens each


def test_a_restored_turn_takes_the_fewest_chunks_that_hold_its_new_tokens(model, fingerprint):
    """Chunks are cut from where a prefill's computation starts: a turn of 60 new tokens after a
    restored history of 100 takes one chunk of 64 (cut at multiples of 64, it would take two: each
    chunk is a pass, and where experts stream from a pack a pass reads the pack)."""
    cache = PromptCache(model, fingerprint, ram_bytes=64 * MIB)
    history = ids(model, 100, seed=8)
    cache.prefill(history)
    turn = history + ids(model, 60, seed=9)
    prefill, steps = ChunkedPrefill(model, turn, cache), 1
    while not prefill.step(PrefillChunks(64)):
        steps += 1
    assert (prefill.reused, steps) == (100, 1)
    assert torch.equal(prefill.logits, cold(model, turn))
    cache.close()


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


def test_a_conversation_longer_than_the_disk_budget_keeps_its_newest_state(model, fingerprint, tmp_path):
    """One conversation whose files outgrow the disk budget: eviction frees what a snapshot's file
    holds besides the rows its children need (an older turn's KDA state and logits: the file keeps
    only its latent rows), so the newest turn stays on disk and a restarted cache resumes from it with
    the cold bits. Taking only files no other refers to would drop each new turn's file at once."""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    conversation(model, probe, 2)
    budget = probe.disk_used  # two turns' four files; the conversation writes sixteen
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", budget, every=1 << 20)
    prompts = conversation(model, cache, 8)
    assert cache.stats.evictions_disk > 0 and cache.disk_used <= budget
    cache.close()
    found = headers(cache.disk_dir)
    assert any(header.get("rows_only") for header in found.values())  # older turns: their rows only
    assert all(header["parent"][0] in found for header in found.values() if "parent" in header)
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", budget)
    prompt = prompts[-1] + [3]
    got = restarted.prefill(prompt)
    assert got.reused == len(prompts[-1]) and torch.equal(got.logits, cold(model, prompt))
    restarted.close()
    directory = cache.disk_dir
    for length, header in found.items():  # the files that chain through a rows-only one, gone
        if length > min(n for n, h in found.items() if h.get("rows_only")):
            (directory / file_name(tuple(header["tokens"]))).unlink()
    PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", budget).close()
    assert not any(header.get("rows_only") for header in headers(directory).values())


def test_a_full_file_system_keeps_a_conversations_newest_state(model_path, model, fingerprint, tmp_path):
    """A disk tier on a file system smaller than its budget (a tmpfs of about two turns' files, in a
    mount namespace of its own): once the file system is full, each new file takes the place of the least
    valuable old ones, as under `--cache-disk`, so a restarted cache resumes from the newest turn with the
    cold bits. (Each file that did not fit was a write error, and the disk held the first turns only.)"""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    conversation(model, probe, 2)
    probe.close()
    pages = sum(-(-path.stat().st_size // 4096) for path in probe.disk_dir.iterdir())
    folder = tmp_path / "small"
    folder.mkdir()
    worker = [sys.executable, str(Path(__file__).with_name("full_disk_worker.py"))]
    command = ["unshare", "--user", "--map-root-user", "--mount", *worker]
    command += [str(model_path), str(folder), str((pages + 2) * 4096)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    except FileNotFoundError:
        pytest.skip("no `unshare` (util-linux) to mount a small file system")
    if "unshare:" in done.stderr or "mount:" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"errors": 0, "reused": got["newest"], "newest": got["newest"], "cold": True}, got


def test_a_cache_directory_removed_while_in_use_is_made_again(model, fingerprint, tmp_path, caplog):
    """The whole `--cache-dir` removed under a running cache (a cleanup of ~/.cache): the next snapshot
    file makes its folder again, with a warning, and a restarted cache resumes the conversation's
    newest state. (Every later file failed to be written, each with a warning, until a restart.)"""
    import shutil

    directory = tmp_path / "states"
    cache = PromptCache(model, fingerprint, 64 * MIB, directory, 1 << 30, every=1 << 20)
    conversation(model, cache, 1, seed=5)
    shutil.rmtree(directory)
    with caplog.at_level(logging.WARNING, logger="k3stream.engine.prompt_cache"):
        prompts = conversation(model, cache, 3, seed=6)
    assert "was removed while in use; made again" in caplog.text
    assert cache.stats.disk_errors == 0
    cache.close()
    restarted = PromptCache(model, fingerprint, 64 * MIB, directory, 1 << 30)
    prompt = prompts[-1] + [3]
    got = restarted.prefill(prompt)
    assert got.reused == len(prompts[-1]) and torch.equal(got.logits, cold(model, prompt))
    restarted.close()


def test_two_caches_of_one_key_on_one_directory_keep_within_its_budget(model, fingerprint, tmp_path):
    """Two servers of the same model and flags on one `--cache-dir` (one folder, each writing its own
    files into it): each counts the other's files in its folder and evicts its own to fit, so together
    they keep within `--cache-disk`. (Each counted only its own files: together they held up to twice the
    budget.)"""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    conversation(model, probe, 2)
    budget = 3 * probe.disk_used
    probe.close()
    caches = [PromptCache(model, fingerprint, 64 * MIB, tmp_path / "shared", budget) for _ in range(2)]
    for seed in range(3):
        for number, cache in enumerate(caches):
            conversation(model, cache, 2, seed=10 * seed + number)
    for cache in caches:
        cache.close()
    files = list(caches[0].disk_dir.iterdir())
    assert len(files) > 4 and sum(path.stat().st_size for path in files) <= budget


def test_a_file_another_cache_of_one_key_writes_later_is_restored_and_left_to_its_writer(
    model, fingerprint, tmp_path
):
    """Two servers of one key on one folder: a snapshot the other writes after this one started is
    restored here (looked for where the folder changed: `needs_read` says so, `read_ahead` lists it),
    with the cold bits; this cache's own eviction then takes its own files, never the other's (that
    one's sessions), and the files keep within the budget."""
    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    probe.prefill(ids(model, 40))
    probe.close()
    budget = int(2.5 * probe.disk_used)
    here = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "shared", budget)
    there = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "shared", budget)
    tokens = ids(model, 40, seed=5)
    there.prefill(tokens)
    there.flush()
    (theirs,) = there.disk_dir.glob(f"*{SUFFIX}")
    assert here.needs_read(tokens)
    here.read_ahead(tokens)
    got = here.prefill(tokens)
    assert got.reused == len(tokens) and torch.equal(got.logits, cold(model, tokens))
    for seed in range(6, 10):
        here.prefill(ids(model, 40, seed=seed))
        here.flush()
    files = list(here.disk_dir.glob(f"*{SUFFIX}"))
    assert theirs in files and len(files) > 1 and sum(path.stat().st_size for path in files) <= budget
    for cache in (here, there):
        cache.close()


def test_a_snapshot_file_is_written_from_its_tensors_own_memory(model, fingerprint, tmp_path):
    """The writer thread copies no tensor while it holds the GIL (a copy of a real model's ~400 MB of
    KDA state would stop the scheduler for all of it): a file's parts are views of the snapshot's own
    tensors, the checksum taken over them, and the file reads back whole."""
    import numpy as np

    from k3stream.model.kda import KDAState

    cache = PromptCache(model, fingerprint, 64 * MIB)
    tokens = ids(model, 40)
    cache.prefill(tokens)
    snapshot = cache._tree.deepest(tokens, len(tokens)).snapshot
    parts = encode(fingerprint, tuple(tokens), snapshot)
    views = [part for part in parts if isinstance(part, memoryview)]
    addresses = {np.frombuffer(view, dtype=np.uint8).ctypes.data for view in views}
    kda = [layer for layer in snapshot.layers if isinstance(layer, KDAState)]
    tensors = [t for layer in kda for t in (layer.conv, layer.recurrent)]
    tensors += [layer.rows() for layer in snapshot.latents()] + [snapshot.logits]
    assert {tensor.data_ptr() for tensor in tensors} == addresses and len(views) == len(tensors)
    back, _, _ = decode(b"".join(parts), fingerprint, tuple(tokens), cache.layout)
    assert torch.equal(back.logits, snapshot.logits)
    cache.close()


def test_disk_eviction_removes_and_rewrites_files_outside_the_lock(model, fingerprint, tmp_path, monkeypatch):
    """The writer thread deletes evicted files and rewrites trimmed ones with the cache's lock free:
    the scheduler's snapshots and restores (which take it) never wait on the disk. Another thread
    takes the lock at each deletion and each rewrite of a snapshot file."""
    from k3stream.engine import prompt_cache

    probe = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "probe", 1 << 30)
    conversation(model, probe, 2)
    probe.close()
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", probe.disk_used, every=1 << 20)
    free = {"unlink": [], "rewrite": []}

    def take_and_release(got: list[bool]) -> None:
        got.append(cache._lock.acquire(timeout=2))  # held by the deleting or rewriting thread: False
        if got[-1]:
            cache._lock.release()

    def lock_is_free() -> bool:
        got: list[bool] = []
        other = threading.Thread(target=take_and_release, args=(got,))
        other.start()
        other.join()
        return got[0]

    real_unlink, real_write = Path.unlink, prompt_cache.write_bytes_atomic

    def unlink(path, missing_ok=False):
        if path.suffix == SUFFIX:
            free["unlink"].append(lock_is_free())
        real_unlink(path, missing_ok=missing_ok)

    def write(path, payload):
        if path.exists():  # a trim rewrites a file in place; a new snapshot's file is new
            free["rewrite"].append(lock_is_free())
        real_write(path, payload)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(prompt_cache, "write_bytes_atomic", write)
    conversation(model, cache, 8)
    conversation(model, cache, 4, seed=1)  # another conversation: files of the first go
    cache.close()
    assert free["unlink"] and free["rewrite"] and all(free["unlink"] + free["rewrite"]), free
    assert cache.disk_used <= probe.disk_used
    kept = [h["tokens"] for h in headers(cache.disk_dir).values() if "rows_only" not in h]
    restarted = PromptCache(model, fingerprint, 64 * MIB, tmp_path / "tight", probe.disk_used)
    prompt = max(kept, key=len) + [3]
    got = restarted.prefill(prompt)
    assert got.reused == len(prompt) - 1 and torch.equal(got.logits, cold(model, prompt))
    restarted.close()


def _answered(cache: PromptCache, model, prompt: list[int], steps: int = 3):
    """`prompt` prefilled through `cache`, `steps` greedy tokens decoded after it and the response's end
    saved: the prefill's result (its state now at the response's end) and the answer's tokens."""
    got = cache.prefill(prompt)
    answer = [int(got.logits.argmax())]
    for _ in range(steps):
        answer.append(int(model.decode(got.state, answer[-1]).argmax()))
    cache.save(prompt + answer[:-1], got.state)
    return got, answer


def test_a_next_turn_appends_to_its_conversations_rows_in_place_and_a_branch_copies(model, fingerprint):
    """The next turn restored from the response's end shares that snapshot's latent buffer (no copy of
    the history's rows); a branch from the prompt's end, whose rows the response wrote past, copies
    them: each goes on with the cold bits, and neither writes into the other's rows."""
    cache = PromptCache(model, fingerprint, 64 * MIB)
    prompt = ids(model, 40)
    first, answer = _answered(cache, model, prompt)
    buffers = [layer.buffer for layer in first.state.layers if hasattr(layer, "buffer")]
    assert buffers
    following = prompt + answer + ids(model, 9, seed=5)
    branch = prompt + ids(model, 6, seed=6)
    turn = cache.prefill(following)
    turn_buffers = [layer.buffer for layer in turn.state.layers if hasattr(layer, "buffer")]
    assert turn.reused == len(prompt) + 3 and all(a is b for a, b in zip(turn_buffers, buffers, strict=True))
    other = cache.prefill(branch)
    other_buffers = [layer.buffer for layer in other.state.layers if hasattr(layer, "buffer")]
    assert other.reused == len(prompt)
    assert not any(a is b for a, b in zip(other_buffers, buffers, strict=True))
    for got, tokens in ((turn, following), (other, branch), (turn, following), (other, branch)):
        token = int(got.logits.argmax())
        got.logits = model.decode(got.state, token)  # each appends a row; the other's stay
        tokens.append(token)
        assert torch.equal(got.logits, cold(model, tokens))
    cache.close()


def test_ram_eviction_weighs_what_a_snapshot_frees_not_the_rows_it_shares(model, fingerprint):
    """A prompt's end and its response's end share one latent buffer: dropping either frees its KDA
    copies only. Just over the budget, the cache drops another prompt's snapshot, whose buffer is its
    own, rather than one of the pair that frees next to nothing."""
    cache = PromptCache(model, fingerprint, 64 * MIB)
    prompt = ids(model, 20)
    got, answer = _answered(cache, model, prompt)
    pair = [entry.snapshot for entry in cache._tree.entries()]
    assert len({snapshot.latents()[0].storage_key() for snapshot in pair}) == 1
    alone = ids(model, 25, seed=9)
    cache.prefill(alone)
    with cache._lock:
        cache.ram_budget = cache.ram_bytes - 1
        cache._evict_ram()
    left = {entry.tokens for entry in cache._tree.entries() if entry.snapshot is not None}
    assert left == {tuple(prompt), tuple(prompt + answer[:-1])} and cache.ram_bytes <= cache.ram_budget
    cache.close()


def test_a_chunk_that_ends_at_a_snapshot_position_is_snapshotted_there(model, fingerprint):
    """Chunks cut where `--cache-every` falls (every 512 tokens against every 1024, say) keep those
    snapshots: a prefill's marks are inside a pass, a chunk's end is not."""
    cache = PromptCache(model, fingerprint, ram_bytes=64 * MIB, every=40)
    tokens = ids(model, 130, seed=5)
    prefill = ChunkedPrefill(model, tokens, cache)
    while not prefill.step(PrefillChunks(40)):
        pass
    branch = tokens[:125] + ids(model, 5, seed=6)
    restored = cache.prefill(branch)
    assert restored.reused == 120
    assert torch.equal(restored.logits, cold(model, branch))
    cache.close()


def test_chunks_of_a_model_whose_only_mla_layer_is_the_last_keep_their_tokens(tiny_model):
    """A prefill pass sends only its last row through the last layer's attention: where that is the
    only MLA layer (the shipped model's shape) a deep chunk costs what the first does, and chunks keep
    `--prefill-chunk` tokens however deep the prompt (not a tenth of them)."""
    last_only = k3stream.load(tiny_model(mla_layers=(5,))).config
    assert attention_rows_per_token(last_only) == math.inf
    chunks = PrefillChunks(64, attention_rows_per_token(last_only))
    assert chunks.next_end(3000, 4096) == 3064
    both = k3stream.load(tiny_model(mla_layers=(3, 5))).config
    assert math.isfinite(attention_rows_per_token(both))


def test_a_prompt_of_a_responses_ids_is_whole_only_where_its_restored_tier_holds_logits(
    model, fingerprint, tmp_path
):
    """A response's end goes to disk without logits; the same ids sent back as a prompt keep their
    end's logits in RAM only. Once RAM drops that snapshot, the file (no logits) serves the prompt short
    of its last token, which is computed: the cold logits, never a prompt with nothing left to run."""
    cache = PromptCache(model, fingerprint, 64 * MIB, tmp_path, 1 << 30, every=1 << 20)
    prompt = ids(model, 20)
    _, answer = _answered(cache, model, prompt)
    history = prompt + answer[:-1]
    cache.flush()
    assert cache.prefill(history).reused == len(prompt)
    budget, cache.ram_budget = cache.ram_budget, 1
    cache.prefill(ids(model, 5, seed=3))  # RAM holds nothing past this
    cache.ram_budget = budget
    again = cache.prefill(history)
    assert again.reused == len(prompt) and torch.equal(again.logits, cold(model, history))
    cache.close()


def test_a_shard_rewritten_in_place_between_the_sampled_windows_is_another_model(tiny_model, tmp_path):
    """The fingerprint samples windows of a large shard's bytes: a shard rewritten in place, its size
    kept and its bytes changed only between the windows, must still key another folder (its snapshots
    are a state of the old weights); a shard renamed, its bytes and time kept, keeps its fingerprint."""
    import shutil

    from k3stream.pack.integrity import SHARD_SAMPLE_BYTES, sample_offsets

    shard = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model(n_experts=64), shard)
    os.utime(shard, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = model_fingerprint([shard])
    size = shard.stat().st_size
    windows = sample_offsets(0, size)
    middle = len(windows) // 2
    unsampled = windows[middle] + SHARD_SAMPLE_BYTES + 8  # between two windows, in the tensor data
    assert unsampled < windows[middle + 1]
    with open(shard, "r+b") as stream:
        stream.seek(unsampled)
        byte = stream.read(1)
        stream.seek(unsampled)
        stream.write(bytes([byte[0] ^ 0x40]))
    rewritten = model_fingerprint([shard])
    assert shard.stat().st_size == size and rewritten != before
    assert model_fingerprint([shard.rename(tmp_path / "renamed.gguf")]) == rewritten


WITHOUT_C_KERNELS = """
import sys
sys.modules["k3stream.quant.kernels._ggml_cpu"] = None  # an install whose C extension was not built
import torch, k3stream
from k3stream.engine.prompt_cache import PromptCache
from k3stream.memlimit import MIB
model = k3stream.load(sys.argv[1])
tokens = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
cache = PromptCache(model, "no-kernels", 64 * MIB, every=16)
cold = lambda ids: model.prefill_last(model.new_state(), ids)
assert not cache.snapshots_anywhere
for length in (16, 21, 32):
    cache.prefill(tokens[:length])
got = cache.prefill(tokens)
assert got.reused == 0 and torch.equal(got.logits, cold(tokens)), got.reused
again = cache.prefill(tokens[:21])
assert again.reused == 21 and torch.equal(again.logits, cold(tokens[:21]))
assert cache.counts()["ram_snapshots"] == 4  # the prompts' ends alone: the rest serves no restore
"""


def test_without_the_c_kernels_the_cache_restores_only_whole_prompts(model_path):
    """Without the C kernels (torch's fallbacks and the chunked KDA recurrence) a prefill resumed from a
    snapshot gets other bits than the cold one, at multiples of the KDA chunk too: the cache then
    serves only a prompt seen whole (its kept logits are the cold prefill's) and computes the rest."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_C_KERNELS, str(model_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_prefill_marks_only_the_snapshots_its_ram_budget_holds(model, fingerprint):
    """A pass keeps a copy of the KDA states at each of its marks until it ends: with `every` 1 and a
    budget of three snapshots' states, a long prompt's pass marks its three deepest positions, not one
    a token; the prefill has the cold bits and the deepest marks restore."""
    from k3stream.model.snapshot import take_snapshot

    state_bytes = take_snapshot(model.new_state()).fixed_bytes
    cache = PromptCache(model, fingerprint, 3 * state_bytes + state_bytes // 2, every=1)
    assert cache.marks(0, 400) == [397, 398, 399]
    tokens = ids(model, 60)
    assert torch.equal(cache.prefill(tokens).logits, cold(model, tokens))
    longer = tokens[:58] + [3, 4]
    assert cache.prefill(longer).reused == 58
    cache.close()


def test_a_file_of_another_arithmetic_is_refused_naming_that_not_the_model_file(model, model_path, tmp_path):
    """A saved state read by a cache over the same model file loaded with other arithmetic (or another
    k3stream build) is refused as such; it was called "a snapshot of another model file", which sent
    a user who upgraded k3stream looking for a wrong file. Another file's key still says so."""
    tokens = ids(model, 20)
    saving = PromptCache(model, "f" * 16, 64 * MIB)
    saving.prefill(tokens)
    path = tmp_path / "slot.bin"
    saving.export(tokens, path)
    saving.close()
    other = k3stream.load(model_path, k3stream.LoadOptions(match_ggml=False))
    for reader, reason in (
        (PromptCache(other, "f" * 16, 64 * MIB), "this model file computed by another k3stream build"),
        (PromptCache(model, "e" * 16, 64 * MIB), "a snapshot of another model file"),
    ):
        with pytest.raises(ValueError, match=reason):
            reader.import_file(path)
        reader.close()
