"""Adaptive prefetch in the expert store: replays of a fixed routing sequence over a real pack, with
hints that are always right, always wrong, or wrong and then right.

After each hint the test waits for the store's single prefetch thread to drain (a no-op job queued
behind the hint), so every issued prefetch lands before the fetch it is meant for and the counts
below do not depend on thread timing.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore
from k3stream.store.cache import WorkingSetTooLarge
from k3stream.store.hints import PREFETCH_DECAY, PREFETCH_MIN_PRECISION

MIB = 1 << 20
TOKENS = 24


@pytest.fixture(scope="module")
def pack(tiny_model, tmp_path_factory) -> ExpertPack:
    gguf_path = tiny_model()
    out = tmp_path_factory.mktemp("prefetch-pack")
    return ExpertPack(build_pack(gguf_path, out / "tiny.pack", out / "tiny.manifest.json").manifest)


def routed_steps(pack: ExpertPack, experts: int) -> list[tuple[int, list[int]]]:
    """TOKENS decode steps over every MoE layer, each routing to top_k of the first `experts` ids."""
    rng = np.random.default_rng(7)
    return [
        (layer, [int(e) for e in rng.choice(experts, size=pack.top_k, replace=False)])
        for _ in range(TOKENS)
        for layer in pack.moe_layers
    ]


def drain(store: ExpertStore) -> None:
    """Wait for the hints and read-ahead queued so far (a no-op job behind them on each thread)."""
    for thread in (store._prefetcher, store._reader_ahead):
        if thread is not None:
            thread.submit(lambda: None).result()


def replay(pack: ExpertPack, steps, hints, **options) -> dict:
    """Fetch each step after hinting `hints[index]` for its layer; a quarter of the experts fit."""
    ram_mib = max(pack.top_k, pack.num_experts * len(pack.moe_layers) // 4) * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=ram_mib, policy="lru", **options) as store:
        for (layer, experts), hint in zip(steps, hints, strict=True):
            store.prefetch(layer, hint)
            drain(store)
            store.fetch(layer, experts)
            if layer == pack.moe_layers[-1]:
                store.end_token()
        return store.stats()


def wrong_hints(pack: ExpertPack, steps) -> list[list[int]]:
    """Experts from the upper half of the ids, which `routed_steps(pack, num_experts // 2)` never uses."""
    half = pack.num_experts // 2
    return [[half + (e + index) % half for e in range(pack.top_k)] for index, _ in enumerate(steps)]


def test_perfect_hints_keep_prefetch_on_and_raise_the_hit_rate(pack):
    steps = routed_steps(pack, pack.num_experts)
    hints = [experts for _, experts in steps]
    off = replay(pack, steps, hints, prefetch=False)
    on = replay(pack, steps, hints)
    assert on["prefetch_adaptive"] and on["prefetch_suppressed"] == 0
    assert all(layer == {"precision": 1.0, "active": True} for layer in on["prefetch_layers"].values())
    assert off["tiers"]["ram"]["hit_rate"] < 0.5
    assert on["tiers"]["ram"]["hit_rate"] > 0.95
    assert on["prefetch_hits"] + on["prefetch_waits"] == on["prefetch_loads"] > 0


def test_wrong_hints_stop_after_the_warm_up_and_cost_about_no_reads(pack):
    steps = routed_steps(pack, pack.num_experts // 2)
    hints = wrong_hints(pack, steps)
    off = replay(pack, steps, hints, prefetch=False)
    always = replay(pack, steps, hints, adaptive_prefetch=False)
    adaptive = replay(pack, steps, hints)
    assert off["prefetch_requests"] == off["prefetch_loads"] == 0
    layers = adaptive["prefetch_layers"].values()
    assert all(layer["precision"] < PREFETCH_MIN_PRECISION and not layer["active"] for layer in layers)

    # warm-up: after n wrong hints of top_k experts a layer's precision is its prior (one right hint
    # of top_k) decayed n times over that plus the decayed wrong ones; it turns off below the
    # threshold (a hinted expert still resident from an earlier wrong hint is not read again)
    def precision_after(n: int) -> float:
        return PREFETCH_DECAY**n / (PREFETCH_DECAY**n + sum(PREFETCH_DECAY**i for i in range(n)))

    hints_before_off = next(n for n in range(1, 50) if precision_after(n) < PREFETCH_MIN_PRECISION)
    warm_up = hints_before_off * pack.top_k * len(pack.moe_layers)
    assert 0 < adaptive["prefetch_loads"] <= warm_up
    assert adaptive["prefetch_hits"] == adaptive["prefetch_waits"] == 0
    assert adaptive["prefetch_suppressed"] == adaptive["prefetch_requests"] - warm_up
    assert always["prefetch_loads"] > 4 * warm_up and always["prefetch_hits"] == 0
    extra_adaptive = adaptive["pack_read_bytes"] - off["pack_read_bytes"]
    extra_always = always["pack_read_bytes"] - off["pack_read_bytes"]
    # each wasted read may also have pushed out an expert that a later fetch reads again
    assert 0 <= extra_adaptive <= 2 * warm_up * pack.object_bytes < extra_always / 4


def test_a_layer_whose_hints_turn_right_gets_prefetch_back(pack):
    steps = routed_steps(pack, pack.num_experts // 2)
    wrong = wrong_hints(pack, steps)
    switch = len(steps) // 2
    hints = wrong[:switch] + [experts for _, experts in steps[switch:]]
    stats = replay(pack, steps, hints)
    # TOKENS // 2 right hints per layer lift its precision from below 0.1 to above 0.9
    assert all(layer["precision"] > 0.9 and layer["active"] for layer in stats["prefetch_layers"].values())
    assert stats["prefetch_hits"] > 0 and stats["prefetch_suppressed"] > 0


def test_speculation_never_takes_more_than_half_the_slots(pack):
    ram_mib = 4 * pack.top_k * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=ram_mib, adaptive_prefetch=False) as store:
        layer, other = pack.moe_layers[0], pack.moe_layers[1]
        capacity = store.max_experts_per_fetch
        store.fetch(layer, range(pack.top_k))
        store.prefetch(layer, range(pack.top_k, pack.top_k + capacity // 2))  # the whole share
        store.prefetch(other, range(pack.top_k))  # the share is taken: skipped
        drain(store)
        stats = store.stats()
    assert stats["prefetch_loads"] == capacity // 2
    assert stats["prefetch_skipped"] == pack.top_k


def test_read_ahead_loads_the_next_part_once_and_never_counts_as_a_hint(pack):
    """The MoE's read-ahead of the next part of a step: loaded in the background, fetched without a
    second read, not scored (a layer whose predictions were all wrong still reads ahead)."""
    layer = pack.moe_layers[0]
    steps = routed_steps(pack, pack.num_experts // 2)
    wrong = wrong_hints(pack, steps)
    ram_mib = 4 * pack.top_k * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=ram_mib, policy="lru") as store:
        for (step_layer, experts), hint in zip(steps, wrong, strict=True):  # switch the layer's hints off
            store.prefetch(step_layer, hint)
            drain(store)
            store.fetch(step_layer, experts)
        assert store.stats()["prefetch_layers"][str(layer)]["active"] is False
        half = pack.num_experts // 2  # the upper half: never routed above, so not resident
        first, second = [half, half + 1, half + 2], [half + 3, half + 4, half + 5]
        store.fetch(layer, first)
        before = store.stats()
        store.read_ahead(layer, second)
        drain(store)
        store.fetch(layer, second)
        stats = store.stats()
    assert stats["read_ahead"] == 3
    assert stats["pack_reads"] == before["pack_reads"] + 3  # read ahead once; the fetch found them resident
    assert stats["prefetch_layers"][str(layer)]["active"] is False  # unscored: the hints stay off
    # read for this fetch, only earlier: misses, and neither prefetch loads nor prefetch uses
    ram, ram_before = stats["tiers"]["ram"], before["tiers"]["ram"]
    assert (ram["cache_hits"], ram["cache_misses"]) == (
        ram_before["cache_hits"],
        ram_before["cache_misses"] + 3,
    )
    for counter in ("prefetch_loads", "prefetch_hits", "prefetch_waits"):
        assert stats[counter] == before[counter], counter


def test_what_a_step_reads_ahead_stays_until_it_is_fetched(pack):
    """Experts read ahead are pinned for the reading thread: the step's other fetches cannot evict
    them, so none is read twice; a fetch of another layer lets them go."""
    layer, other = pack.moe_layers[0], pack.moe_layers[1]
    k = pack.top_k
    ahead, rest, new, later = ([*range(start, start + k)] for start in range(0, 4 * k, k))
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB, policy="lru") as store:
        store.read_ahead(layer, ahead)
        drain(store)
        store.fetch(layer, rest)  # the cache is full
        store.fetch(layer, new)  # only `rest` may make room: `ahead` waits for its fetch
        reads = store.stats()["pack_reads"]
        store.fetch(layer, ahead)
        assert store.stats()["pack_reads"] == reads  # still resident: not read twice
        store.read_ahead(layer, later)
        drain(store)
        with pytest.raises(WorkingSetTooLarge):  # `later` holds k of the 2k slots
            store.fetch(layer, rest + new[:-1])
        store.fetch(other, [0])  # another layer: what was read ahead for `layer` is let go
        store.fetch(layer, rest + new[:-1])


def test_read_ahead_is_not_queued_behind_hints_and_reads_before_them(pack):
    """A step's read-ahead runs on its own thread, so a hint's long load cannot hold it up, and its pack
    reads queue after demand reads and before hints'."""
    layer, other = pack.moe_layers[0], pack.moe_layers[1]
    with ExpertStore(pack, ram_mib=4 * pack.top_k * pack.object_bytes / MIB, policy="lru") as store:
        priorities: list[tuple[int, list[tuple[int, int]]]] = []
        start = store._reader.start

        def recorded(keys, priority, read_here=False):
            priorities.append((priority, list(keys)))
            return start(keys, priority, read_here)

        store._reader.start = recorded
        held = threading.Event()
        store._prefetcher.submit(held.wait, 10)  # a hint load that has not finished
        store.prefetch(other, [0])
        store.read_ahead(layer, [1, 2])
        store._reader_ahead.submit(lambda: None).result(timeout=10)  # done while the hint waits
        assert store.ready(layer, [0, 1, 2]) == [1, 2]
        store.fetch(layer, [3])
        held.set()
        drain(store)
    assert sorted(priorities) == [(0, [(layer, 3)]), (1, [(layer, 1), (layer, 2)]), (2, [(other, 0)])]


def test_a_prefetch_waits_for_its_layer_before_it_goes_first(pack):
    """An expert prefetched for a layer whose step has not come is evicted only when nothing else can
    go (a precise hint sent a layer early must survive the step before it); once its layer's step
    passed without it, it is the first to go."""
    layer, following = pack.moe_layers[0], pack.moe_layers[1]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=(2 * k + 1) * pack.object_bytes / MIB, policy="lru") as store:
        store.fetch(layer, list(range(k)))
        store.prefetch(following, [0])
        drain(store)
        store.fetch(layer, list(range(k, 2 * k)))  # the cache is full
        store.fetch(layer, list(range(2 * k, 3 * k)))  # evicts the first step, not the prefetch
        before = store.stats()
        store.fetch(following, [0])
        after = store.stats()
        assert after["pack_reads"] == before["pack_reads"] and after["prefetch_hits"] == 1
        store.fetch(layer, [2 * k])  # another layer's step: a hint now is for `following`'s next
        store.prefetch(following, [1])
        drain(store)
        store.fetch(following, [2])  # its layer's step goes on without it: still fresh
        store.fetch(layer, [2 * k])  # another layer: that step is over, and [1] was not used
        store.fetch(layer, list(range(k)))  # so it is the first to go
        assert store.stats()["prefetch_unused_evictions"] == 1


def test_a_hint_larger_than_the_share_of_hints_reads_its_first_experts_up_to_the_share(pack):
    """A tier that cannot hold a whole hint beside the step in progress reads the hint's first experts
    (the likeliest: a prediction lists them first) up to the hints' share, and drops the rest."""
    layer = pack.moe_layers[0]
    hint = list(range(pack.top_k, -1, -1))  # top_k + 1 experts, the likeliest first
    with ExpertStore(pack, ram_mib=2 * pack.top_k * pack.object_bytes / MIB) as store:
        store.prefetch(layer, hint)  # the share is max(top_k, half the slots)
        drain(store)
        stats = store.stats()
        assert store.ready(layer, hint) == hint[: pack.top_k]
    assert stats["prefetch_loads"] == stats["pack_reads"] == pack.top_k
    assert stats["prefetch_too_large"] == 1


def assert_read_after_the_sweep(store: ExpertStore, layer: int, later: int, experts: list[int]) -> None:
    """Once `layer`'s sweeping step has fetched, a hint of `experts` for `later` reads them."""
    store.fetch(layer, [0])
    store.release()
    store.prefetch(later, experts)
    drain(store)
    assert store.ready(later, experts) == experts


def test_a_hint_larger_than_the_share_and_hints_behind_it_evict_nothing(pack):
    """The step a hint that large predicts sweeps the tier: what the tier holds for it is the step's own
    reads to keep or evict, so such a hint reads into free slots only, and so does a hint for a layer
    whose step comes after that one (the sweep would evict what it read before its layer came: a
    prefill's token hint for its last MoE layer); once the sweeping layer was fetched, a hint within
    the share evicts as ever."""
    layer, later, third = pack.moe_layers[:3]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB) as store:
        for start in (0, k):  # the tier full of experts no step holds
            store.fetch(layer, list(range(start, start + k)))
        store.release()
        large = list(range(2 * k, 3 * k + 1))
        store.prefetch(layer, large)
        drain(store)
        assert store.ready(layer, large) == [] and store.ready(layer, range(2 * k)) == list(range(2 * k))
        small = list(range(k))
        store.prefetch(later, small)
        drain(store)
        assert store.ready(later, small) == [] and store.ready(layer, range(2 * k)) == list(range(2 * k))
        assert store.stats()["pack_reads"] == 2 * k
        assert_read_after_the_sweep(store, layer, third, small)


def test_a_hint_naming_more_absent_experts_than_the_share_evicts_nothing_whatever_its_allowance(pack):
    """A warm prefill after a long decode: the layer's allowance (here its prior) is below the hints'
    share, but its hint names more absent experts than the share: the step it predicts sweeps the
    tier, so the hint reads into free slots only (none in a full tier) and evicts nothing."""
    layer, *others = pack.moe_layers[:3]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=4 * k * pack.object_bytes / MIB) as store:
        share = store.max_experts_per_fetch // 2
        assert math.ceil(k / PREFETCH_MIN_PRECISION) < share  # the allowance reads fewer than the share
        for other in others:  # the tier full of experts no step holds
            for start in (0, k):
                store.fetch(other, list(range(start, start + k)))
        store.release()
        hint = list(range(share + 1))
        store.prefetch(layer, hint)
        drain(store)
        assert store.ready(layer, hint) == [] and store.stats()["pack_reads"] == 4 * k


def test_a_hint_behind_a_sweeping_step_reads_nothing_even_into_free_slots(pack):
    """A cold prefill: the first layer's hint predicts a step that sweeps the tier; a hint for a later
    layer before that step reads nothing, though slots are free (the step would take them and evict
    what it read, unused); after that step it reads as ever."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=4 * k * pack.object_bytes / MIB) as store:
        share = store.max_experts_per_fetch // 2
        store.prefetch(layer, list(range(share + 1)))  # sweeps: reads its allowance into free slots
        small = list(range(k // 2))
        store.prefetch(later, small)
        drain(store)
        assert store.ready(later, small) == []
        assert (
            store.stats()["pack_reads"] == math.ceil(k / PREFETCH_MIN_PRECISION) < store.max_experts_per_fetch
        )
        assert_read_after_the_sweep(store, layer, later, small)


def test_a_hint_behind_a_sweeping_step_is_not_scored(pack):
    """A prefill's last layer: its layer-ahead hints, always wrong here, come behind the first layer's
    sweeping step and read nothing, so they do not count against the layer's record; its hints at its
    own start, right, keep it on."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB) as store:
        share = store.max_experts_per_fetch // 2
        assert pack.num_experts - store.max_experts_per_fetch > share  # the first hint always sweeps
        for step in range(6):
            store.prefetch(layer, list(range(pack.num_experts)))
            store.prefetch(later, [k + (step + i) % (pack.num_experts - k) for i in range(k)])  # wrong
            drain(store)
            store.fetch(layer, list(range(k)))
            right = list(range(step % 2 * k, step % 2 * k + k))
            store.prefetch(later, right)
            drain(store)
            store.fetch(later, right)
            store.end_token()
        store.release()
        records = store.stats()["prefetch_layers"]
    assert records[str(later)] == {"precision": 1.0, "active": True}


def test_a_switched_off_layers_hint_still_marks_its_step_as_sweeping(pack):
    """A warm prefill whose first layer's hints are switched off (imprecise): its hint reads nothing,
    but still names a step that sweeps the tier, and a later layer's hint before that step reads
    nothing, though slots are free."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=4 * k * pack.object_bytes / MIB) as store:
        share = store.max_experts_per_fetch // 2
        for wrong in range(k, k + 4):  # one-expert hints never fetched switch the layer's hints off
            store.prefetch(layer, [wrong])
            drain(store)
            store.fetch(layer, list(range(k)))
            store.end_token()
        store.release()
        assert not store.stats()["prefetch_layers"][str(layer)]["active"]
        hint = list(range(pack.num_experts))
        assert len(hint) - len(store.ready(layer, hint)) > share
        store.prefetch(layer, hint)
        small = list(range(k // 2))
        store.prefetch(later, small)
        drain(store)
        assert store.ready(later, small) == []


def test_a_hint_after_one_that_filled_free_slots_only_is_its_steps_first_that_may_evict(pack):
    """A prefill's last layer: its first hint came behind a sweeping step and read nothing into a full
    tier; once that step has fetched, the layer's next hint for the same step (at the layer's start)
    reads, evicting what no step pins, as a first hint does; a hint after that one fills free slots only."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB) as store:
        for start in (0, k):  # the tier full of experts no step holds
            store.fetch(layer, list(range(start, start + k)))
        store.release()
        store.prefetch(layer, list(range(2 * k, 3 * k + 1)))  # larger than the share: it sweeps
        first = list(range(k // 2))
        store.prefetch(later, first)  # behind the sweep: free slots only, and none is free
        drain(store)
        assert store.ready(later, first) == [] and store.stats()["pack_reads"] == 2 * k
        store.fetch(layer, [0])  # the sweeping step
        store.release()
        second = list(range(k // 2, k))
        store.prefetch(later, second)
        drain(store)
        assert store.ready(later, second) == second
        third = [k]
        store.prefetch(later, third)
        drain(store)
        assert store.ready(later, third) == []


def test_a_cold_tiers_free_slots_take_a_fill_beyond_the_hints_share(pack):
    """A cold tier (a cold prefill): the step's first hint, larger than the hints' share, reads the share;
    the hint that follows it for the same step fills the free slots left, beyond the share (a fill
    evicts nothing, and the step it predicts sweeps the tier anyway), and no more than are free."""
    layer, k = pack.moe_layers[0], pack.top_k
    with ExpertStore(pack, ram_mib=3 * k * pack.object_bytes / MIB, adaptive_prefetch=False) as store:
        slots = store.max_experts_per_fetch
        share = max(k, slots // 2)
        first = list(range(share + 2))
        store.prefetch(layer, first)
        drain(store)
        assert store.ready(layer, first) == first[:share]
        second = list(range(share + 2, pack.num_experts))
        assert len(second) > slots - share
        store.prefetch(layer, second)
        drain(store)
        stats = store.stats()
        assert store.ready(layer, second) == second[: slots - share]
    assert stats["prefetch_loads"] == stats["pack_reads"] == slots
    assert stats["tiers"]["ram"]["cache_evictions"] == 0


def test_a_hint_that_follows_another_for_the_same_step_evicts_nothing(pack):
    """A prefill sends a layer two hints before its step (layer-ahead, then pre-attention): the second
    reads into free slots only, so a warm tier keeps what it holds; once the layer's step has fetched,
    its next hint evicts as ever."""
    layer, k = pack.moe_layers[0], pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB) as store:
        for start in (0, k):  # the tier full of experts no step holds
            store.fetch(layer, list(range(start, start + k)))
        store.release()
        first, second = [2 * k], [2 * k + 1]
        store.prefetch(layer, first)
        drain(store)
        store.prefetch(layer, second)
        drain(store)
        assert store.ready(layer, first + second) == first
        store.fetch(layer, first)
        store.release()
        store.prefetch(layer, second)
        drain(store)
        assert store.ready(layer, second) == second


def test_another_layers_step_between_two_hints_lets_the_second_evict(pack):
    """A cold prefill's last layer: its layer-ahead hint goes out before the first layer's step, which
    may evict what it read (that step sweeps the tier); the layer's next hint for the same step (at its
    start, after that step) is again the first that may evict, and reads into a full tier."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB, policy="lru") as store:
        for start in (0, k):  # the tier full of experts no step holds
            store.fetch(layer, list(range(start, start + k)))
        store.release()
        first = list(range(k // 2))
        store.prefetch(later, first)  # may evict: the least recently used of `layer`'s go
        drain(store)
        assert store.ready(later, first) == first
        store.fetch(layer, list(range(2 * k, 3 * k)))  # another layer's step between the hints
        store.release()
        second = list(range(k // 2, k))
        store.prefetch(later, second)
        drain(store)
        assert store.ready(later, second) == second


def test_a_step_evicts_what_a_hint_named_for_a_later_step_only_when_nothing_else_can_go(pack):
    """A hint naming experts the tier holds keeps them for its layer's step as it keeps its reads: a
    prefill's sweep of one layer evicted the next layer's hinted experts (least recently used here),
    and that layer read them again at its router. Once their step has used them they go as ever."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=2 * k * pack.object_bytes / MIB, policy="lru") as store:
        named = list(range(k))
        store.fetch(later, named)  # the least recently used
        store.fetch(layer, list(range(k)))
        store.release()
        store.prefetch(later, named)  # all held: nothing to read
        drain(store)
        store.fetch(layer, list(range(k, 2 * k)))  # evicts k: the unnamed ones
        store.release()
        assert store.ready(later, named) == named
        assert store.ready(layer, range(k)) == []
        store.fetch(later, named)  # their step
        store.fetch(layer, list(range(k, 2 * k)))  # the named ones least recently used again
        store.release()
        store.fetch(layer, list(range(k)))  # evicted as ever
        assert store.ready(later, named) == []
        assert store.stats()["pack_reads"] == 4 * k


def test_what_a_hint_keeps_for_its_layers_next_step_outlasts_the_steps_between(pack):
    """A hint sent right after its layer's step (the next token's, in a model of two MoE layers) keeps
    what it names through the other layer's step, which ends the hinted layer's step in progress."""
    layer, later = pack.moe_layers[:2]
    k = pack.top_k
    with ExpertStore(pack, ram_mib=(2 * k + 1) * pack.object_bytes / MIB, policy="lru") as store:
        named = list(range(k))
        store.fetch(later, named)  # the least recently used
        store.fetch(layer, list(range(k)))
        store.fetch(later, [k])  # the hinted layer's step
        store.release()
        store.prefetch(later, named)  # for its next step
        drain(store)
        store.fetch(layer, list(range(k, 2 * k)))  # evicts k: the unnamed ones
        assert store.ready(later, named) == named
        assert store.ready(layer, range(k)) == []


def test_a_hint_of_experts_all_resident_or_loading_queues_no_read(pack):
    """Nothing to read: the hint is counted and keeps its experts for their step, and no job wakes the
    prefetch thread (a decode whose budget holds its experts pays no thread hand-off a layer)."""
    layer = pack.moe_layers[0]
    everything = pack.num_experts * len(pack.moe_layers) * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=everything, policy="lru") as store:
        queued = []
        submit = store._prefetcher.submit
        store._prefetcher.submit = lambda job, *args: queued.append(args) or submit(job, *args)
        store.fetch(layer, list(range(pack.top_k)))
        store.prefetch(layer, list(range(pack.top_k)))
        assert queued == []
        store.prefetch(layer, list(range(pack.top_k + 1)))  # one absent: read
        assert [[expert for _, expert in keys] for keys, *_ in queued] == [list(range(pack.top_k + 1))]
        drain(store)  # its no-op job is queued too
        store.prefetch(layer, list(range(pack.top_k + 1)))
        assert len(queued) == 2
        assert store.stats()["prefetch_requests"] == 3 * pack.top_k + 2
