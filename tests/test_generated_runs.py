"""The memory of answers the model wrote in tokens of its own: a text between special tokens whose ids are
not the tokenizer's is kept with those ids, by the ids before it, nothing else, in bounded memory, and
found again from the states a restarted server or a restored slot holds (tiny model)."""

from __future__ import annotations

import pytest

from k3stream.server.generated_runs import GeneratedRuns, PrefixDigest

PROMPT = [1, 2, 3]


def spelled(tokenizer, text: str) -> list[int]:
    """`text` one character's tokens at a time: the ids a model may write where the tokenizer merges."""
    return [token for character in text for token in tokenizer.encode_plain(character)]


def merged_word(tokenizer) -> str:
    """A word the tokenizer writes in fewer tokens than its characters."""
    word = next(
        (w for w in ("the", " the", "ing", " and", "er", "in") if len(tokenizer.encode_plain(w)) < len(w)),
        None,
    )
    assert word is not None, "the tokenizer merges none of the words tried"
    return word


def digest(ids: list[int]) -> int:
    return PrefixDigest().at(ids)


def test_a_text_written_in_ids_of_its_own_is_kept_after_the_ids_before_it(tokenizer):
    word = merged_word(tokenizer)
    end = next(iter(tokenizer.special_tokens.values()))
    runs = GeneratedRuns(tokenizer)
    ids, plain = spelled(tokenizer, word), tokenizer.encode_plain("plain text")
    runs.remember(PROMPT, [*plain, end, *ids, end])
    assert runs.ids(digest([*PROMPT, *plain, end]), word) == tuple(ids)
    assert runs.ids(digest([*PROMPT, 9, *plain, end]), word) is None  # another conversation
    assert runs.ids(digest(PROMPT), "plain text") is None  # the tokenizer's own ids: nothing to keep


def test_a_cut_character_or_special_token_text_is_not_kept(tokenizer):
    """No text sent back stands for the first byte of a two-byte character (it comes back as U+FFFD), and
    a text that spells a special token is refused or written with that token."""
    first_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.piece(i) == "é".encode()[:1])
    runs = GeneratedRuns(tokenizer)
    runs.remember(PROMPT, [*spelled(tokenizer, "caf"), first_byte])
    runs.remember(PROMPT, spelled(tokenizer, next(iter(tokenizer.special_tokens))))
    assert runs._runs == {}


def test_the_least_recently_used_go_first_past_the_bound(tokenizer):
    word = merged_word(tokenizer)
    others = [f"{word}{index}" for index in range(3)]
    size = len(others[0]) + len(spelled(tokenizer, others[0]))
    runs = GeneratedRuns(tokenizer, max_size=2 * size)
    for text in others[:2]:
        runs.remember(PROMPT, spelled(tokenizer, text))
    assert runs.ids(digest(PROMPT), others[0]) is not None  # now the most recently used
    runs.remember(PROMPT, spelled(tokenizer, others[2]))
    assert [runs.ids(digest(PROMPT), text) is not None for text in others] == [True, False, True]


@pytest.fixture
def served(model_path, one_torch_thread):
    from k3stream.engine.loading import load_runtime
    from k3stream.server.runtime import served_from_runtime

    served = served_from_runtime(load_runtime(model_path))
    yield served
    if served.prompt_cache is not None:
        served.prompt_cache.close()
    served.close()


def _answered(served) -> tuple[list[dict], str, list[int]]:
    """A question, an answer the model wrote in ids of its own, and the ids of the state a turn saves."""
    word = merged_word(served.tokenizer)
    question = [{"role": "user", "content": "Hi"}]
    return question, word, served.encode_chat(question) + spelled(served.tokenizer, word)


def _assert_the_next_turn_matches_past_the_answer(served, question, word, answered) -> None:
    """The next turn's history is written in the answer's ids, so its match goes on past the answer; a
    conversation the states do not hold gets the tokenizer's ids."""
    history = [*question, {"role": "assistant", "content": word}, {"role": "user", "content": "More?"}]
    assert served.prompt_cache.cached_length(served.encode_chat(history)) == len(answered)
    elsewhere = [{"role": "user", "content": "Hello"}, *history[1:]]
    rendered = served.chat_template.render(elsewhere)
    assert served.encode_chat(elsewhere) == served.tokenizer.encode(rendered, allow_special=True)


def test_a_restarted_server_writes_an_answer_its_states_on_disk_hold_in_the_ids_the_model_wrote(
    served, tmp_path
):
    """After a restart over the same `--cache-dir`, the records of the answers the model wrote in ids of
    its own are rebuilt from the snapshots on disk (the records live in RAM), as before the restart."""
    from k3stream.commands.serve import use_prompt_cache
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.memlimit import MIB

    question, word, answered = _answered(served)
    first = PromptCache(served.model, "restart", 64 * MIB, tmp_path, 1 << 30)
    first.prefill(answered)
    first.close()  # the server stops; its snapshot files stay
    served.generated_runs = GeneratedRuns(served.tokenizer)  # what a restarted process holds
    use_prompt_cache(served, PromptCache(served.model, "restart", 64 * MIB, tmp_path, 1 << 30))
    _assert_the_next_turn_matches_past_the_answer(served, question, word, answered)


def test_a_restored_slot_writes_the_answers_it_holds_in_the_ids_the_model_wrote(served, tmp_path):
    """llama-server's slot restore into another server: the answers the file's state holds are written
    in the model's ids when sent back, as in the server that saved it."""
    import httpx

    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.memlimit import MIB
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread

    question, word, answered = _answered(served)
    saving = PromptCache(served.model, "slot", 64 * MIB)
    saving.prefill(answered)
    saving.export(answered, tmp_path / "conv.k3slot")
    saving.close()
    served.prompt_cache = PromptCache(served.model, "slot", 64 * MIB)
    with ServerThread(create_app(served, ServerConfig(max_batch=1, slot_save_path=tmp_path))) as server:
        body = {"filename": "conv.k3slot"}
        restored = httpx.post(server.url + "/slots/0?action=restore", json=body, timeout=120).json()
        assert restored["n_restored"] == len(answered)
    _assert_the_next_turn_matches_past_the_answer(served, question, word, answered)
