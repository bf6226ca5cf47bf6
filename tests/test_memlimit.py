"""`--memory-limit`: sizes, cgroup detection on fake /proc and /sys trees, the plan and its refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3stream.memlimit import (
    MIB,
    MemoryLimitError,
    MemoryPlan,
    ModelNeeds,
    cgroup_limit,
    default_memory_limit,
    format_size,
    headroom_bytes,
    own_memory_cgroup,
    parse_size,
    plan_memory,
)
from k3stream.server.app import PREFILL_PASS_PROMPTS

NEEDS = ModelNeeds(
    nonexpert_bytes=100 * MIB,
    state_bytes=10 * MIB,
    working_bytes=20 * MIB,
    object_bytes=MIB,
    top_k=8,
    expert_bytes=4096 * MIB,
    tokens=512,
)
RUNTIME = 200 * MIB
PLANNED = RUNTIME + 130 * MIB  # the runtime, non-expert weights, state and working buffers of NEEDS


def limit_leaving(room: int) -> int:
    """The smallest limit that leaves `room` bytes beside NEEDS, the runtime and the headroom."""
    limit = PLANNED + room
    while (short := room - (limit - PLANNED - headroom_bytes(limit))) > 0:
        limit += short
    return limit


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1536M", 1536 * MIB), ("1.5GiB", 1536 * MIB), ("200MiB", 200 * MIB), ("4g", 4 << 30), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_names_the_flag():
    with pytest.raises(ValueError, match=r"--memory-limit: 'lots' is not a size"):
        parse_size("lots")


def test_plan_gives_experts_what_is_left():
    limit = 1 << 30
    plan = plan_memory(limit, NEEDS, RUNTIME)
    assert plan.expert_budget == limit - PLANNED - headroom_bytes(limit)
    assert f"expert RAM budget {format_size(plan.expert_budget)} (" in plan.summary()


def test_the_headroom_is_the_kernels_share_of_the_limit_and_one_uncached_read():
    """1/256 of the limit (page tables and slab: 5.8 MiB measured for 2.5 GB resident) and 16 MiB read
    with a 2 MiB folio either side: 36 MiB of a 4 GiB limit, under 1% of 64 GiB."""
    assert headroom_bytes(4 << 30) == 16 * MIB + 20 * MIB
    assert headroom_bytes(64 << 30) < (64 << 30) // 100
    assert (
        f"headroom {format_size(headroom_bytes(1 << 30))}" in plan_memory(1 << 30, NEEDS, RUNTIME).summary()
    )


def test_the_prompt_cache_comes_out_of_the_expert_budget():
    plan = plan_memory(limit_leaving(300 * MIB), NEEDS, RUNTIME, cache_bytes=100 * MIB)
    assert plan.expert_budget == 200 * MIB
    assert "prompt cache 100.0 MiB -> expert RAM budget 200.0 MiB" in plan.summary()
    with pytest.raises(MemoryLimitError, match=r"prompt cache \(100.0 MiB\)"):
        plan_memory(limit_leaving(100 * MIB), NEEDS, RUNTIME, cache_bytes=100 * MIB)


def test_plan_never_exceeds_the_routed_experts():
    assert plan_memory(limit_leaving(10 * 4096 * MIB), NEEDS, RUNTIME).expert_budget == NEEDS.expert_bytes


def test_plan_holds_exactly_one_working_set():
    assert plan_memory(limit_leaving(8 * MIB), NEEDS, RUNTIME).expert_budget == 8 * MIB


def test_plan_refuses_below_one_working_set_in_one_line():
    limit = limit_leaving(8 * MIB) - 1
    with pytest.raises(MemoryLimitError) as error:
        plan_memory(limit, NEEDS, RUNTIME, source="--memory-limit")
    message = str(error.value)
    assert "\n" not in message
    assert "non-expert weights (100.0 MiB)" in message
    assert "top-k working set (8 x 1048576 bytes)" in message
    assert f"needs at least {(PLANNED + headroom_bytes(limit) + 8 * MIB) / MIB:.1f} MiB" in message


def test_a_refusal_the_prompt_cache_makes_names_its_flag():
    """`serve` and `chat` keep 1 GiB for the prompt cache unless told: under a limit that holds everything
    else, the refusal names --cache-ram, the flag that lowers it; without a cache it does not."""
    cache = 1024 * MIB
    limit = limit_leaving(8 * MIB + cache) - 1
    with pytest.raises(MemoryLimitError) as error:
        plan_memory(limit, NEEDS, RUNTIME, cache_bytes=cache)
    assert "prompt cache (1.00 GiB)" in str(error.value)
    assert str(error.value).endswith("(--cache-ram sets the prompt cache: 0 turns it off)")
    assert plan_memory(limit, NEEDS, RUNTIME).expert_budget > 8 * MIB
    with pytest.raises(MemoryLimitError) as error:
        plan_memory(limit_leaving(8 * MIB) - 1, NEEDS, RUNTIME)
    assert "--cache-ram" not in str(error.value)


def _fake_tree(tmp_path: Path, cgroup_lines: str) -> tuple[Path, Path]:
    proc, sys_cgroup = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    sys_cgroup.mkdir()
    return proc, sys_cgroup


def test_cgroup_v1_limit_is_the_smallest_up_the_tree(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "4:memory:/outer/inner\n1:cpu:/\n0::/\n")
    inner = sys_cgroup / "memory" / "outer" / "inner"
    inner.mkdir(parents=True)
    (inner / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (inner.parent / "memory.limit_in_bytes").write_text(f"{1536 * MIB}\n")
    assert own_memory_cgroup(proc, sys_cgroup) == inner
    assert cgroup_limit(inner, sys_cgroup) == 1536 * MIB
    assert default_memory_limit(proc, sys_cgroup) == (1536 * MIB, f"cgroup {inner}")


def test_cgroup_v2_limit(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "0::/job\n")
    job = sys_cgroup / "job"
    job.mkdir()
    (job / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text(f"{200 * MIB}\n")
    assert own_memory_cgroup(proc, sys_cgroup) == job
    assert default_memory_limit(proc, sys_cgroup)[0] == 200 * MIB


def test_no_limit_falls_back_to_available_ram(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "0::/job\n")
    job = sys_cgroup / "job"
    job.mkdir()
    (job / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text("max\n")
    assert default_memory_limit(proc, sys_cgroup) == (20000000 * 1024, "available RAM")


def test_no_cgroup_mounted_falls_back_to_available_ram(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "4:memory:/gone\n0::/gone\n")
    assert own_memory_cgroup(proc, sys_cgroup) is None
    assert default_memory_limit(proc, sys_cgroup) == (20000000 * 1024, "available RAM")


@pytest.mark.parametrize("limited", [True, False])
def test_ranks_on_one_machine_each_plan_for_their_share_of_it(tmp_path, monkeypatch, limited):
    """torchrun's LOCAL_WORLD_SIZE ranks share their machine's cgroup limit (or available RAM): each
    plans for its share (each planned for all of it, and two ranks held up to twice the limit)."""
    proc, sys_cgroup = _fake_tree(tmp_path, "0::/job\n")
    job = sys_cgroup / "job"
    job.mkdir()
    (job / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text(f"{3000 * MIB}\n" if limited else "max\n")
    whole, source = default_memory_limit(proc, sys_cgroup)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_memory_limit(proc, sys_cgroup) == (whole // 2, f"{source}, shared by 2 ranks")


def test_pinning_the_malloc_mmap_threshold_reports_whether_it_could():
    from k3stream.memlimit import pin_malloc_mmap_threshold

    assert isinstance(pin_malloc_mmap_threshold(), bool)


# ---- the plan's arithmetic at Kimi-K3's real dimensions (nothing allocated) ----------------------

# a 3-layer slice at the real shapes: layer 0 dense, layers 1-2 MoE, layer 2 MLA (the last layer is);
# 21.4 GB of routed experts in the audited recipe, 2.1 GB of non-expert weights in Q8_0
SLICE_EXPERTS, SLICE_NONEXPERT, SLICE_RUNTIME = 21_400_000_000, 2_100_000_000, 227 * MIB


def real_slice_config():
    from k3stream.gguf.config import K3Config

    return K3Config(
        source="real-dimension slice",
        n_layers=3,
        hidden=7168,
        vocab_size=163840,
        context_length=262144,
        dense_ff=18432,
        n_heads=96,
        head_count_kv=(0, 0, 1),
        rms_eps=1e-5,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head_dim=128,
        conv_kernel=4,
        kda_head_dim=128,
        gate_lower_bound=-5.0,
        n_experts=896,
        top_k=16,
        expert_ff=3072,
        n_shared=2,
        n_dense=1,
        latent=3584,
        weights_scale=2.5,
        weights_norm=True,
        gating_func=2,
        situ_beta=4.0,
        situ_linear_beta=25.0,
        block_size=12,
    )


def slice_plan(ctx, limit=SLICE_NONEXPERT + (3 << 30), sequences=1):
    from k3stream.memlimit import ServedShape, config_needs

    shape = ServedShape(ctx=ctx, sequences=sequences)
    needs = config_needs(real_slice_config(), SLICE_EXPERTS, SLICE_NONEXPERT, shape)
    return plan_memory(limit, needs, SLICE_RUNTIME)


def test_state_is_the_caches_of_the_served_context():
    """64 tokens: the MLA layer's cache of 64 rows of 576 floats (and 32 rows of the buffer it grew
    from), two KDA layers' 96 x 128 x 128 recurrent states and 3 x 96 x 128 x 3 conv inputs."""
    plan = slice_plan(64)
    mla = (64 + 32) * 576 * 4
    kda = 2 * (96 * 128 * 128 + 3 * 96 * 128 * 3) * 4
    assert plan.needs.state_bytes == mla + kda
    assert plan.needs.tokens == 64
    assert "KV/state for 64 tokens" in plan.summary()


def test_a_servers_batch_holds_the_state_of_each_sequence():
    one, batch = slice_plan(1024), slice_plan(1024, sequences=16)
    assert batch.needs.state_bytes == 16 * one.needs.state_bytes
    assert batch.needs.working_bytes == one.needs.working_bytes  # one prefill at a time
    assert batch.expert_budget == one.expert_budget - 15 * one.needs.state_bytes
    assert "KV/state for 1024 tokens x 16 sequences" in batch.summary()


def test_a_larger_context_never_gives_experts_more():
    budgets = [slice_plan(ctx).expert_budget for ctx in (64, 256, 512, 1024)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


def test_the_default_context_keeps_4096_tokens_of_state_and_gives_experts_more_than_a_fixed_reserve():
    """Without `--ctx`: state for 4,096 tokens, a prefill of 256 rows; the fixed reserve it replaces
    (246 MiB of state, 399 MiB of buffers at these shapes) left experts 75% of what the runtime and
    the non-expert weights leave."""
    plan = slice_plan(None)
    left = plan.limit - SLICE_RUNTIME - SLICE_NONEXPERT
    assert plan.needs.tokens == 4096
    assert plan.expert_budget / left > 0.85


@pytest.mark.parametrize("ctx", [64, 16 + 128, 1024])
def test_experts_get_95_percent_of_what_the_served_context_leaves(ctx):
    """Everything but the caches and one prefill's buffers of the served context goes to experts, but
    the headroom: at least 95% of it (a 16-token prompt and `generate`'s 128 output tokens is 144)."""
    plan = slice_plan(ctx)
    left = plan.limit - SLICE_RUNTIME - SLICE_NONEXPERT - plan.needs.state_bytes - plan.needs.working_bytes
    assert plan.expert_budget == left - plan.headroom
    assert plan.expert_budget / left >= 0.95


def test_a_context_beyond_the_model_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--ctx 300000 must be between 2 and the model's context length"):
        slice_plan(300000)


def test_generate_sizes_its_plan_for_ctx(tiny_model, tmp_path):
    """`generate --ctx 64 --memory-limit`: the plan printed is for 64 tokens."""
    import subprocess
    import sys

    from k3stream.pack.builder import build_pack
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(), tmp_path)).manifest
    command = [sys.executable, "-m", "k3stream", "generate", str(manifest), "--memory-limit", "2GiB"]
    command += ["--ctx", "64", "--prompt", "hi", "--max-tokens", "1", "--temperature", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "KV/state for 64 tokens" in done.stderr, done.stderr[-2000:]


def test_a_streamed_generate_stays_inside_the_cgroup_limit_its_plan_splits(tiny_model, tmp_path):
    """A child memory cgroup whose limit leaves about half the routed experts: `generate` plans from the
    cgroup's limit for its prompt and output (no `--ctx`), fills its expert budget, and finishes
    without an OOM kill or a single charge that hit the limit (no reclaim, no thrash)."""
    import os
    import subprocess
    import sys

    from bench_helpers import pack_expert_bytes
    from k3stream.gguf.layout import is_routed_expert
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.builder import build_pack
    from k3stream.testing.cgroups import ChildCgroup, drop_page_cache
    from pack_helpers import copy_model

    model = copy_model(tiny_model(n_layers=4, n_experts=64, top_k=8, expert_ff=256, latent=512), tmp_path)
    manifest = build_pack(model).manifest
    experts = pack_expert_bytes(manifest)
    tensors = K3Checkpoint.open(model).tensors.values()
    nonexpert = sum(t.nbytes for t in tensors if not is_routed_expert(t.name))
    limit = nonexpert + experts // 2 + 300 * MIB  # the runtime (~230 MiB), state, buffers, headroom
    cgroup = ChildCgroup.create(f"test-memlimit-{os.getpid()}", limit)
    if isinstance(cgroup, str):
        pytest.skip(cgroup)
    command = [sys.executable, "-m", "k3stream", "generate", str(manifest), "--threads", "2"]
    command += ["--prompt", "the quick brown fox " * 8, "--max-tokens", "16", "--temperature", "0"]
    try:
        os.sync()
        drop_page_cache(model, manifest.with_name(manifest.name.removesuffix(".manifest.json")))
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=cgroup.join)
        usage = cgroup.usage()
    finally:
        cgroup.remove()
    assert done.returncode == 0, done.stderr[-2000:]
    plan = next(line for line in done.stderr.splitlines() if line.startswith("memory limit"))
    budget_mib = float(plan.split("expert RAM budget ")[1].split(" MiB")[0])
    assert experts / 4 < budget_mib * MIB < experts, plan  # the limit binds, the budget is used
    served = int(plan.split("KV/state for ")[1].split(" tokens")[0])
    assert 16 < served < 200, plan  # the prompt and 16 tokens, not the default 4,096
    assert "hit rate" in done.stderr
    assert usage["oom_kills"] in (0, None) and usage["limit_hits"] == 0, (usage, plan)
    assert usage["peak_bytes"] <= limit


# expert rows of whole 256-value blocks (the audited and dynamic recipes' K-quants)
WIDE = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)


@pytest.mark.parametrize("recipe", ["audited", "dynamic"])
def test_a_limit_with_room_for_every_expert_gives_the_store_a_slot_for_each(tiny_model, tmp_path, recipe):
    """The store holds each expert in a slot of the pack's largest object, its roles on 4 KiB
    boundaries: the audited recipe's 71,168 GGUF bytes an expert span 77,312 in the pack, and the
    dynamic recipe's layers differ (53,760 to 94,208). A limit with room for the whole pack must give
    every expert a slot (a budget of their GGUF bytes held 8-23% fewer, and generate re-read experts
    all along under a plan that said 100% of the routed experts)."""
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.pack.builder import build_pack
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(recipe=recipe, **WIDE), tmp_path)).manifest
    command = ["generate", str(manifest), "--memory-limit", "4GiB", "--ctx", "64", "--prompt", "hi"]
    runtime = runtime_from_args(build_parser(command).parse_args(command))
    try:
        objects = len(runtime.store.moe_layers) * runtime.store.num_experts
        assert runtime.store.max_experts_per_fetch == objects
    finally:
        runtime.close()


def test_an_expert_parallel_ranks_plan_caps_its_budget_at_its_share(tiny_model, tmp_path):
    """Under `--ep 2` a rank's store serves half of each layer's experts: a limit with room for the
    whole pack gives it a slot for each of those, not for the whole pack (memory it would never use)."""
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.pack.builder import build_pack
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(**WIDE), tmp_path)).manifest
    command = [
        "generate",
        str(manifest),
        "--memory-limit",
        "4GiB",
        "--ctx",
        "64",
        "--ep",
        "2",
        "--prompt",
        "hi",
    ]
    runtime = runtime_from_args(build_parser(command).parse_args(command))
    try:
        share = len(runtime.store.moe_layers) * runtime.store.num_experts // 2
        assert runtime.store.max_experts_per_fetch == share
    finally:
        runtime.close()


@pytest.mark.parametrize("cache_mib", [0, 256])
def test_the_prompt_cache_is_in_the_default_plan_without_a_pack(tiny_model, monkeypatch, cache_mib):
    """Without a pack the GGUF's routed experts stay in RAM when the default plan (the cgroup's limit,
    else the available RAM) has room for them: room left after the prompt cache's `--cache-ram`, as
    with a pack or `--memory-limit`. The machine's limit here leaves 64 MiB beside the routed experts;
    a 256 MiB prompt cache must send them back to the GGUF (they were kept, 192 MiB over the limit)."""
    import k3stream.memlimit as memlimit
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.gguf.reader import K3Checkpoint

    model = tiny_model()
    checkpoint = K3Checkpoint.open(model)
    plan = memlimit.plan_for_model(checkpoint, "4GiB", memlimit.ServedShape(ctx=64))
    limit = plan.fixed_bytes - plan.headroom + plan.needs.expert_bytes + 64 * MIB
    monkeypatch.setattr(memlimit, "default_memory_limit", lambda: (limit, "the test's limit"))
    command = ["generate", str(model), "--ctx", "64", "--cache-ram", str(cache_mib), "--prompt", "hi"]
    runtime = runtime_from_args(build_parser(command).parse_args(command))
    kept = runtime.model.expert_source.kept_bytes()
    assert kept == (plan.needs.expert_bytes if cache_mib == 0 else 0)


@pytest.mark.parametrize(
    ("flags", "rows"),
    [
        ((), 512 * PREFILL_PASS_PROMPTS),
        (("--max-batch", "2", "--prefill-chunk", "64"), 64 * PREFILL_PASS_PROMPTS),
        (("--max-batch", "9", "--prefill-chunk", "100"), 100 * PREFILL_PASS_PROMPTS),
        (("--no-stream-experts",), 512 * PREFILL_PASS_PROMPTS),
        (("--ctx", "48"), 48 * 16),  # no prompt is longer than the context
    ],
)
def test_serves_plan_holds_its_largest_prefill_pass(tiny_model, tmp_path, capsys, flags, rows):
    """`serve` prefills in passes of PREFILL_PASS_PROMPTS `--prefill-chunk` chunks in one forward (a
    chunk of each of several requests where experts stream from a pack, or all of one prompt whose
    prefill is the only work, whatever `--max-batch`, streamed or from the GGUF): its plan holds the
    activations of that many rows, attending up to the served context."""
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.pack.builder import build_pack
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(), tmp_path)).manifest
    command = ["serve", str(manifest), "--memory-limit", "4GiB", "--cache-ram", "0", *flags]
    runtime_from_args(build_parser(command).parse_args(command)).close()
    plan = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("memory limit"))
    assert f"(a prefill of {rows} rows)" in plan, plan


def test_serves_prefill_passes_run_from_four_prompts_chunks_down_to_one_prompts_smallest():
    from k3stream.server.app import MIN_PREFILL_CHUNK, prefill_passes

    auto = prefill_passes(None)
    assert [(p.prompts, p.chunk) for p in auto[:5]] == [(4, 512), (3, 512), (2, 512), (1, 512), (1, 256)]
    assert (auto[-1].prompts, auto[-1].chunk) == (1, MIN_PREFILL_CHUNK)
    tokens = [p.tokens for p in auto]
    assert tokens == sorted(tokens, reverse=True) and len(set(tokens)) == len(tokens)
    assert [(p.prompts, p.chunk) for p in prefill_passes(100)] == [(4, 100), (3, 100), (2, 100), (1, 100)]


def _serve_needs(checkpoint, manifest, prefill_pass):
    """What `serve MANIFEST` (16 sequences of the default context) needs with `prefill_pass`."""
    from k3stream.memlimit import ServedShape, model_needs
    from k3stream.pack.reader import ExpertPack

    slot = ExpertPack(manifest).object_bytes
    return model_needs(
        checkpoint, ServedShape(sequences=16, slot_bytes=slot, prefill_rows=prefill_pass.tokens)
    )


def _limit_holding(needs, runtime):
    """The smallest limit whose plan holds `needs` beside one top-k working set."""
    limit = runtime + needs.nonexpert_bytes + needs.state_bytes + needs.working_bytes + needs.working_set
    while (short := MemoryPlan(limit, "", runtime, needs, 0).fixed_bytes + needs.working_set - limit) > 0:
        limit += short
    return limit


def _expert_budget(checkpoint, manifest, prefill_pass, limit):
    """The expert budget `serve`'s plan leaves beside `prefill_pass` under `limit`; None where it does
    not fit."""
    try:
        return plan_memory(limit, _serve_needs(checkpoint, manifest, prefill_pass), RUNTIME).expert_budget
    except MemoryLimitError:
        return None


@pytest.mark.parametrize("held", [0, 1, 2, 5, -1, None])  # the limit that just holds this pass; None: ample
def test_serve_sizes_its_prefill_pass_to_what_the_limit_leaves(
    tiny_model, tmp_path, capsys, monkeypatch, held
):
    """Without `--prefill-chunk`, `serve` takes the largest prefill pass that leaves the experts at
    least half the budget the smallest pass leaves: every larger pass does not fit or leaves less. The
    pass is printed in the plan and handed to the server (`args.prefill_pass`)."""
    import k3stream.memlimit as memlimit
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.builder import build_pack
    from k3stream.server.app import prefill_passes
    from pack_helpers import copy_model

    model = copy_model(tiny_model(), tmp_path)
    manifest = build_pack(model).manifest
    checkpoint = K3Checkpoint.open(model)
    passes = prefill_passes(None)
    monkeypatch.setattr(memlimit, "resident_bytes", lambda: RUNTIME)  # the plan's runtime term, fixed
    needs = _serve_needs(checkpoint, manifest, passes[0 if held is None else held])
    limit = _limit_holding(needs, RUNTIME) + (4 * needs.expert_bytes if held is None else 0)
    command = ["serve", str(manifest), "--memory-limit", str(limit), "--cache-ram", "0"]
    args = build_parser(command).parse_args(command)
    runtime_from_args(args).close()
    chosen = passes.index(args.prefill_pass)
    budgets = [_expert_budget(checkpoint, manifest, p, limit) for p in passes]
    assert 2 * budgets[chosen] >= budgets[-1]
    assert all(b is None or 2 * b < budgets[-1] for b in budgets[:chosen])
    if held is None:  # ample room: the largest pass
        assert chosen == 0
    if held == -1:  # room for the smallest pass only
        assert chosen == len(passes) - 1
    plan = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("memory limit"))
    assert f"(a prefill of {passes[chosen].tokens} rows)" in plan, plan


def test_the_server_runs_the_prefill_pass_its_config_names(tiny_model, tmp_path):
    """`ServerConfig.pass_prompts` (what `serve` sets from its plan) and `prefill_chunk` make the
    scheduler's pass, and a prompt alone's, and the startup line names them."""
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.commands.serve import pass_note
    from k3stream.pack.builder import build_pack
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.runtime import served_from_runtime
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(), tmp_path)).manifest
    command = ["serve", str(manifest), "--ram-mib", "64"]
    served = served_from_runtime(runtime_from_args(build_parser(command).parse_args(command)), ctx=256)
    try:
        budgets = {}
        for prompts in (1, 3):
            config = ServerConfig(prefill_chunk=64, pass_prompts=prompts)
            scheduler = create_app(served, config).state.scheduler
            budgets[prompts] = scheduler.pass_budget
            assert scheduler.idle_chunks.tokens == prompts * 64  # no stream decoding: the pass's rows
            rows = f"{prompts * 64} rows while no stream decodes"
            assert pass_note(config, served) == f"{prompts} x 64 tokens ({rows})"
        assert budgets[3] == 3 * budgets[1]
    finally:
        served.close()


@pytest.mark.parametrize(("flags", "smallest"), [((), 32), (("--prefill-chunk", "100"), 100)])
def test_serve_refuses_only_when_one_prompts_smallest_chunk_does_not_fit(
    tiny_model, tmp_path, monkeypatch, flags, smallest
):
    """One byte below the limit holding one prompt's smallest chunk (`MIN_PREFILL_CHUNK` tokens, or the
    given `--prefill-chunk`), `serve` refuses in one line naming that pass's rows."""
    import k3stream.memlimit as memlimit
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.builder import build_pack
    from k3stream.server.app import PrefillPass
    from pack_helpers import copy_model

    model = copy_model(tiny_model(), tmp_path)
    manifest = build_pack(model).manifest
    monkeypatch.setattr(memlimit, "resident_bytes", lambda: RUNTIME)
    needs = _serve_needs(K3Checkpoint.open(model), manifest, PrefillPass(1, smallest))
    command = ["serve", str(manifest), "--memory-limit", str(_limit_holding(needs, RUNTIME) - 1)]
    command += ["--cache-ram", "0", *flags]
    with pytest.raises(MemoryLimitError, match=rf"for a prefill of {smallest} rows\)"):
        runtime_from_args(build_parser(command).parse_args(command))


@pytest.mark.parametrize(
    ("limit", "ranks", "expected"), [("2GiB", 1, ""), ("600MiB", 2, " for each of 2 ranks")]
)
def test_a_memory_limit_above_the_cgroups_is_refused_naming_both(
    tiny_model, tmp_path, limit, ranks, expected
):
    """`--memory-limit` (each rank's, under torchrun) larger than the memory cgroup the process runs in
    would plan memory the kernel never grants (an OOM kill mid-run): one line naming both limits."""
    import os
    import subprocess
    import sys

    from k3stream.pack.builder import build_pack
    from k3stream.testing.cgroups import ChildCgroup
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(), tmp_path)).manifest
    cgroup = ChildCgroup.create(f"test-memlimit-above-{os.getpid()}", 1 << 30)
    if isinstance(cgroup, str):
        pytest.skip(cgroup)
    command = [sys.executable, "-m", "k3stream", "generate", str(manifest), "--memory-limit", limit]
    command += ["--prompt", "hi", "--max-tokens", "1"]
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(ranks)}  # what torchrun tells each of its ranks
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, preexec_fn=cgroup.join, env=env
        )
    finally:
        cgroup.remove()
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert (
        f"--memory-limit {format_size(parse_size(limit))}{expected} is above the 1.00 GiB limit"
        in done.stderr
    )


# a model whose routed experts' gate and up products are its largest buffers: 8 of 64 experts a token,
# 1,024 wide, 256 latent
PRODUCTS_HEAVY = dict(n_layers=4, n_experts=64, top_k=8, expert_ff=1024, latent=256, kv_lora=256, qk_nope=32)
PASS_HISTORY, PASS_ROWS = 256, 2048


def _pass_peak(model) -> int:
    """The peak above the process of a `serve` prefill pass (row-exact queries) of PASS_ROWS rows over
    PASS_HISTORY rows of history, after a first pass of that size (the process's first large one)."""
    import torch

    from k3stream.quant.kernels import set_row_exact
    from memory_peak import peak_above

    generator = torch.Generator().manual_seed(0)

    def ids(count: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (count,), generator=generator).tolist()

    set_row_exact(True)
    try:
        state = model.new_state()
        model.prefill_last(state, ids(PASS_HISTORY))
        model.prefill_last(model.fork_state(state), ids(PASS_ROWS))
        resumed = model.fork_state(state)
        return peak_above(lambda: model.prefill_last(resumed, ids(PASS_ROWS)))
    finally:
        set_row_exact(False)


def _pass_needs(path, slot_bytes=None):
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.memlimit import ServedShape, model_needs

    shape = ServedShape(ctx=PASS_HISTORY + PASS_ROWS, prefill_rows=PASS_ROWS, slot_bytes=slot_bytes)
    return model_needs(K3Checkpoint.open(path), shape)


def test_a_prefill_pass_stays_inside_the_working_buffers_its_plan_holds(tiny_model):
    """A pass of `serve`'s on PRODUCTS_HEAVY with its experts in RAM (the step is one kernel call of
    all its pairs) takes at most the working buffers `serve`'s plan holds for that many rows attending
    the context (`ffn_floats`)."""
    import k3stream
    from k3stream.memlimit import pin_malloc_mmap_threshold

    path = tiny_model(recipe="audited", context_length=4096, **PRODUCTS_HEAVY)
    pin_malloc_mmap_threshold()  # as every command does: freed buffers go back to the system
    peak = _pass_peak(k3stream.load(path))
    needs = _pass_needs(path)
    assert 0 < peak <= needs.working_bytes, (peak / MIB, needs.working_bytes / MIB)


# a streamed pass and decode steps measured in a process of their own (`_peaks_apart`)
STREAMED_PEAKS = """
import json
import sys

sys.path.insert(0, sys.argv[4])
from k3stream.engine.loading import load_runtime
from k3stream.memlimit import pin_malloc_mmap_threshold
from k3stream.model.options import LoadOptions
from memory_peak import peak_above
from test_memlimit import _pass_peak

pin_malloc_mmap_threshold()
options = LoadOptions(expert_ram_mib=float(sys.argv[2]), prefetch=sys.argv[3] == "1")
runtime = load_runtime(sys.argv[1], options)
model, store = runtime.model, runtime.store
peak = _pass_peak(model)
state = model.new_state()
model.prefill_last(state, list(range(1, 9)))
decode = peak_above(lambda: [model.decode(state, token) for token in range(1, 5)])
stats = store.stats()
print(json.dumps({"pass": peak, "decode": decode, "per_fetch": store.max_experts_per_fetch, "stats": stats}))
runtime.close()
"""


def _peaks_apart(script: str, *args: str) -> str:
    """What `script` prints, run with `args` and the tests' folder in a process of its own: in a test
    worker's process, memory an earlier test freed can serve a whole measured call, whose peak above
    the start then reads 0."""
    import subprocess
    import sys

    command = [sys.executable, "-c", script, *args, str(Path(__file__).parent)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_streamed_pass_and_decode_stay_inside_their_plan_and_near_it(tiny_model, tmp_path, prefetch):
    """PRODUCTS_HEAVY streamed from its pack through a budget of four top-k working sets: a 2,048-row
    pass of `serve`'s takes at most the working buffers its plan holds, and at least 40% of them (the
    plan counts one expert group's products, `experts.group_pairs`, not every pair's); a decode step
    at most a one-row forward's; and every read buffer the store makes is one of its slots (a group's
    views alive through the next fetch would keep its evicted experts' buffers, and the fetch's reads
    would make new ones beside the budget)."""
    import json

    from k3stream.memlimit import Forward, working_bytes
    from k3stream.pack.builder import build_pack
    from k3stream.pack.reader import ExpertPack
    from pack_helpers import copy_model

    path = copy_model(tiny_model(recipe="audited", context_length=4096, **PRODUCTS_HEAVY), tmp_path)
    manifest = build_pack(path).manifest
    slot = ExpertPack(manifest).object_bytes
    budget_mib = 4 * PRODUCTS_HEAVY["top_k"] * slot / MIB
    measured = json.loads(_peaks_apart(STREAMED_PEAKS, str(manifest), str(budget_mib), str(int(prefetch))))
    needs = _pass_needs(path, slot)
    one_row = working_bytes(needs_config(path), Forward(1, PASS_HISTORY + PASS_ROWS, streamed=True))
    peak, decode, stats = measured["pass"], measured["decode"], measured["stats"]
    assert 0.4 * needs.working_bytes <= peak <= needs.working_bytes, (peak / MIB, needs.working_bytes / MIB)
    assert decode <= one_row, (decode / MIB, one_row / MIB)
    assert stats["pack_reads"] > measured["per_fetch"]  # the experts streamed through the budget
    made = stats["buffers_made"] + stats["buffers_prefaulted"]
    assert made <= measured["per_fetch"], stats


def needs_config(path):
    """The model config of the GGUF at `path`."""
    from k3stream.gguf.reader import K3Checkpoint

    return K3Checkpoint.open(path).config


# measured in a process of its own: in a test worker's process an earlier test's freed memory can take
# the whole prefill, and its peak above the start reads 0
GGUF_EXPERTS_PEAK = """
import sys
import torch
import k3stream
from k3stream.memlimit import pin_malloc_mmap_threshold
from k3stream.model.options import LoadOptions
sys.path.insert(0, sys.argv[3])
from memory_peak import peak_above

pin_malloc_mmap_threshold()
model = k3stream.load(sys.argv[1], LoadOptions(expert_ram_mib=float(sys.argv[2])))
print(model.expert_source.max_experts_per_fetch)
prompt = torch.randint(0, model.config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
model.prefill_last(model.new_state(), prompt.tolist())  # the process's first large forward
print(peak_above(lambda: model.prefill_last(model.new_state(), prompt.tolist())))
"""


def test_experts_read_from_the_gguf_come_within_the_expert_budget(tiny_model):
    """Routed experts that do not all fit the budget are read from the GGUF at each fetch, a fetch at
    most the budget's bytes of them: a 256-row prefill that routes to most of 256 experts a layer (70
    MiB a layer) under a budget of two top-k working sets takes at most the plan's working buffers and
    that budget (a fetch of the step's experts at once took a layer's)."""

    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.memlimit import ServedShape, model_needs

    shape = dict(PRODUCTS_HEAVY, n_layers=3, n_experts=256)
    path = tiny_model(recipe="audited", context_length=4096, **shape)
    needs = model_needs(K3Checkpoint.open(path), ServedShape(ctx=256))
    budget = 2 * needs.working_set
    per_fetch, peak = (
        int(line) for line in _peaks_apart(GGUF_EXPERTS_PEAK, str(path), str(budget / MIB)).split()
    )
    assert per_fetch == 2 * shape["top_k"]
    assert 0 < peak <= needs.working_bytes + budget, (peak / MIB, needs.working_bytes / MIB, budget / MIB)
