"""Fit k3stream to the memory it has: the limit, what must stay resident, and the expert budget left.

`--memory-limit SIZE` (default: this process's memory cgroup limit, else the available RAM) is split as

    limit = runtime (interpreter + torch, measured) + non-expert weights (their GGUF bytes, held in
            anonymous memory) + KV/state + working buffers + headroom (`headroom_bytes`) + prompt cache
            (`--cache-ram`) + expert RAM budget

KV/state and working buffers are computed from the config for the context served (`--ctx`, default
DEFAULT_CTX): the MLA caches and KDA states of a sequence that long, and the activations of a prefill
of that many rows (the engine prefills a prompt in one forward), or of the largest forward a command
that prefills in chunks runs (`serve`'s prefill passes).

and the expert budget must hold at least one top-k working set (top_k x one expert object); below that
the command refuses with one line. The budget is never larger than the pack's routed experts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint

MIB = 1 << 20
GIB = 1 << 30
UNLIMITED = 1 << 60  # cgroup v1 writes 2^63 - page size for "no limit"; anything this large is none
DEFAULT_CTX = 4096  # the context served when none is given (or the model's, if shorter)
DEFAULT_PREFILL_ROWS = 256  # prompt rows a prefill's activations are sized for when no context is given
# the kernel's memory for a process's anonymous pages (page tables, slab), per byte of the limit: measured
# 5.8-6.2 MiB charged (memory.kmem.usage_in_bytes) for 2.5-2.7 GB resident on a real-dimension slice
KERNEL_SHARE = 1 / 256
SLAB_BYTES = 16 * MIB  # float32 rows of a weight dequantised at a time (`quant.matmul.SLAB_BYTES`)
QUERY_BLOCK = 512  # MLA prefill queries attended at a time (`model.mla.QUERY_BLOCK`)
Q8_BLOCK_BYTES, Q8_BLOCK_VALUES = 292, 256  # a Q8_K activation block: scale, 256 int8 values, 16 sums
STREAM_COPIES = 6  # residual-stream rows alive per token: x, its mix, the normed input, attention, sum, FFN

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": MIB, "g": GIB, "t": 1 << 40}


class MemoryLimitError(ValueError):
    """The limit cannot hold what must stay resident plus one top-k working set."""


def parse_size(text: str) -> int:
    """Bytes from `1536M`, `1.5GiB`, `200MiB`, `4g` or a plain byte count (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"--memory-limit: {text!r} is not a size like 1.5GiB, 1536M or 200MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


# ---- what the machine gives --------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def own_memory_cgroup(proc: Path = Path("/proc"), sys_cgroup: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The directory of this process's memory cgroup (v1 memory controller, else v2), if mounted."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # hierarchy-id:controllers:path
        _hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = sys_cgroup / "memory" / path.lstrip("/")
            if directory.is_dir():
                return directory
    for line in lines:
        _hid, controllers, path = line.split(":", 2)
        if controllers == "":
            for root in (sys_cgroup, sys_cgroup / "unified"):
                directory = root / path.lstrip("/")
                if (directory / "cgroup.controllers").is_file():
                    return directory
    return None


def cgroup_limit(directory: Path, stop: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest memory limit on `directory` and its ancestors up to `stop`; None if there is none."""
    limits = []
    current = directory
    while True:
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = _read_int(current / name)
            if value is not None:
                limits.append(value)
        if current == stop or current.parent == current or stop not in current.parents:
            break
        current = current.parent
    return min(limits) if limits else None


def available_memory(proc: Path = Path("/proc")) -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{proc / 'meminfo'}: no MemAvailable line")


def default_memory_limit(
    proc: Path = Path("/proc"), sys_cgroup: Path = Path("/sys/fs/cgroup")
) -> tuple[int, str]:
    """`(bytes, where from)`: the memory cgroup's limit, else the available RAM; under torchrun each of
    the LOCAL_WORLD_SIZE ranks on this machine gets its share (they run in one cgroup, on one RAM)."""
    directory = own_memory_cgroup(proc, sys_cgroup)
    limit = None if directory is None else cgroup_limit(directory, sys_cgroup)
    if limit is not None:
        whole, source = limit, f"cgroup {directory}"
    else:
        whole, source = available_memory(proc), "available RAM"
    ranks = local_ranks()
    return (whole // ranks, f"{source}, shared by {ranks} ranks") if ranks > 1 else (whole, source)


def local_ranks() -> int:
    """The processes torchrun started on this machine (LOCAL_WORLD_SIZE), 1 outside torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def memory_limited(limit_text: str | None) -> bool:
    """Whether this process runs under a memory limit: `--memory-limit`, or its memory cgroup's."""
    if limit_text is not None:
        return True
    directory = own_memory_cgroup()
    return directory is not None and cgroup_limit(directory) is not None


def resident_bytes(proc: Path = Path("/proc")) -> int:
    """This process's resident set (VmRSS), in bytes: the interpreter and libraries loaded so far."""
    for line in (proc / "self" / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- what the model needs ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelNeeds:
    """Bytes a loaded model keeps outside the expert cache, and the expert unit it streams."""

    nonexpert_bytes: int
    state_bytes: int
    working_bytes: int
    object_bytes: int  # one expert's slot: the pack's largest object, else the GGUF's mean expert
    top_k: int
    expert_bytes: int  # every routed expert it holds at once (a rank's share): a slot each, else GGUF bytes
    tokens: int  # the served context: KV/state and a prefill's activations are sized for it
    sequences: int = 1  # KV/state is held for this many sequences at once
    prefill_rows: int = DEFAULT_PREFILL_ROWS  # prompt rows of the largest forward

    @property
    def working_set(self) -> int:
        return self.top_k * self.object_bytes


def state_bytes(config: Any, tokens: int, sequences: int = 1) -> int:
    """Float32 state of `sequences` sequences of `tokens` each: every MLA layer's latent cache (grown by
    doubling from 16 rows, so its capacity, and one layer's old buffer while it grows), every KDA
    layer's recurrent and conv states."""
    capacity = 16 << max(0, math.ceil(math.log2(max(tokens, 1) / 16)))
    row = (config.kv_lora + config.qk_rope) * 4
    mla = len(config.mla_layers) * capacity * row + capacity // 2 * row
    heads, dim = config.kda_heads, config.kda_head_dim
    kda = len(config.kda_layers) * (heads * dim * dim + 3 * heads * dim * max(config.conv_kernel - 1, 0)) * 4
    return sequences * (mla + kda)


def attention_floats(config: Any) -> int:
    """Float32 values per prompt row alive at the wider attention kind's peak. MLA: the gate's logits
    throughout, then the largest of its phases: projecting (q_a and kv_a's outputs, q_b's, the absorbed
    queries and their join with the rope part), attending (the queries and the latent context), the
    output (the context, v_b's output and the gated one). KDA: the joint projection, the convolved
    q, k, v and the output with its gate."""
    heads, kv_lora, rope = config.n_heads, config.kv_lora, config.qk_rope
    queries = heads * (kv_lora + rope)
    projecting = (
        (config.q_lora or 0) + kv_lora + rope + heads * (config.qk_nope + rope) + heads * kv_lora + queries
    )
    attending = queries + heads * kv_lora
    output = heads * kv_lora + 2 * heads * config.v_head_dim
    mla = heads * config.v_head_dim + max(projecting, attending, output)
    inner = config.kda_inner
    kda = 3 * inner + inner + 2 * heads + 3 * inner + 2 * inner
    return max(mla if config.mla_layers else 0, kda if config.kda_layers else 0)


@dataclass(frozen=True)
class Forward:
    """The largest forward a plan holds: `rows` prompt rows attending `keys` positions, each query alone
    (`row_exact`, as `serve`'s prefills do: `kernels.set_row_exact`) or QUERY_BLOCK at a time, its
    routed experts streamed from a pack (`streamed`: the MoE step computes them in groups of at most
    `experts.group_pairs` pairs) or from the GGUF (a step counted as one group, the most it holds)."""

    rows: int
    keys: int
    row_exact: bool = False
    streamed: bool = False


def ffn_floats(config: Any, forward: Forward) -> int:
    """Float32 values alive at the wider feed-forward kind's peak in `forward`: the dense MLP's gate, up
    and activation of each row; or, beside the MoE's router logits, latent input, combined sum and
    choices of each row, the larger of its two phases. The shared experts: their gate and up of each
    row. The routed experts: every pair's output, and one expert group's products (each of its
    pairs' gate and up, the 8-bit blocks of their activation, its outputs where the step has other
    groups, its pair order). A step whose experts are in RAM is one group; a streamed step's groups
    hold at most `experts.group_pairs` pairs."""
    from k3stream.experts import group_pairs

    rows = forward.rows
    dense = 3 * config.dense_ff * rows if config.dense_layers else 0
    if not config.moe_layers:
        return dense
    pairs = rows * config.top_k
    group = group_pairs(rows, config.top_k) if forward.streamed else pairs
    outputs = (pairs + (group if group < pairs else 0)) * config.latent
    products = group * (2 * config.expert_ff + 2) + _block_floats(group * config.expert_ff)
    shared = rows * 2 * config.expert_ff * config.n_shared
    per_row = config.n_experts + 2 * config.latent + 3 * config.top_k
    return max(dense, rows * per_row + max(shared, outputs + products))


def _block_floats(values: int) -> int:
    """Float32 values of the room `values` activations take as 8-bit blocks for the quantized products
    (`match_ggml`; Q8_K's 292 bytes per 256 values, the widest; sub-block sums take less)."""
    return -(-values * Q8_BLOCK_BYTES // (Q8_BLOCK_VALUES * 4))


def activation_bytes(config: Any, forward: Forward) -> int:
    """Float32 activations of `forward`: the residual stream with the attention-residual bank (and the
    stacked copy a mix makes), the wider of a layer's attention and feed-forward, and the MLA scores:
    QUERY_BLOCK queries' at a time, or one query's where each attends alone (`forward.row_exact`)."""
    rows = forward.rows
    banks = -(-config.n_layers // max(config.block_size, 1))
    stream = (STREAM_COPIES + 2 * (banks + 1)) * config.hidden
    layer = max(rows * attention_floats(config), ffn_floats(config, forward))
    queries = 1 if forward.row_exact else min(rows, QUERY_BLOCK)
    scores = 2 * config.n_heads * queries * forward.keys if config.mla_layers else 0
    return 4 * (rows * stream + layer + scores)


def working_bytes(config: Any, forward: Forward) -> int:
    """`forward`'s activations (`activation_bytes`), one row's logits and a dequantisation slab. Reads
    in flight are not here: a load reserves its slot in the expert budget before it reads, and a MoE
    step drops each group's views of the store's buffers before it fetches the next, so every read
    lands in a buffer the budget counts (`store.reader.RecycledBuffers`)."""
    logits = 2 * config.vocab_size * 4
    return activation_bytes(config, forward) + logits + SLAB_BYTES


def served_tokens(config: Any, ctx: int | None) -> int:
    """The context the plan is sized for: `ctx`, else DEFAULT_CTX, never beyond the model's."""
    if ctx is not None and not 1 < ctx <= config.context_length:
        raise ValueError(
            f"--ctx {ctx} must be between 2 and the model's context length {config.context_length}"
        )
    return min(ctx or DEFAULT_CTX, config.context_length)


@dataclass(frozen=True)
class ServedShape:
    """What a command serves, as the memory plan sizes it (nothing here is allocated).

    `ctx`: the context served (None: DEFAULT_CTX, or the model's if shorter). `sequences`: sequences
    whose KV/state is held at once (a server's batch). `slot_bytes`: the expert store's slot when
    experts stream from a pack (its largest object, roles on 4 KiB boundaries), which every expert it
    holds takes; None: the GGUF's bytes. `prefill_rows`: the prompt rows of the largest forward of a
    command that prefills in chunks (`serve`'s prefill passes), attending the served context; None: a
    prompt is prefilled whole (of DEFAULT_PREFILL_ROWS rows when no context was given: a longer prompt
    needs `--ctx`). `expert_ranks`: the expert-parallel ranks a pack's experts are split over (`--ep`):
    a rank holds at most its share."""

    ctx: int | None = None
    sequences: int = 1
    slot_bytes: int | None = None
    prefill_rows: int | None = None
    expert_ranks: int = 1


def config_needs(
    config: Any, expert_bytes: int, nonexpert_bytes: int, shape: ServedShape = ServedShape()
) -> ModelNeeds:
    """What a model of `config` needs besides the expert cache, from its config and byte counts alone,
    serving `shape`: `shape.sequences` sequences of the served context, and a prefill of as many rows,
    or of `shape.prefill_rows` (the chunks of at most that many prompts, each within the context)."""
    tokens = served_tokens(config, shape.ctx)
    if shape.prefill_rows:
        rows = min(shape.prefill_rows, shape.sequences * tokens)
    else:
        rows = tokens if shape.ctx is not None else min(tokens, DEFAULT_PREFILL_ROWS)
    objects = len(config.moe_layers) * config.n_experts
    mean = math.ceil(expert_bytes / objects) if objects else 0
    slot = shape.slot_bytes
    return ModelNeeds(
        nonexpert_bytes=nonexpert_bytes,
        state_bytes=state_bytes(config, tokens, shape.sequences),
        working_bytes=working_bytes(config, _largest_forward(shape, rows, tokens)),
        object_bytes=slot or mean,
        top_k=config.top_k,
        expert_bytes=(objects * slot if slot else expert_bytes) // shape.expert_ranks,
        tokens=tokens,
        sequences=shape.sequences,
        prefill_rows=rows,
    )


def _largest_forward(shape: ServedShape, rows: int, tokens: int) -> Forward:
    """The largest forward of a command serving `shape`: a command that prefills in passes is `serve`,
    whose rows attend the served context one query at a time (row-exact); else a prompt alone."""
    passes = bool(shape.prefill_rows)
    return Forward(rows, tokens if passes else rows, row_exact=passes, streamed=shape.slot_bytes is not None)


def model_needs(checkpoint: Any, shape: ServedShape = ServedShape()) -> ModelNeeds:
    """What `checkpoint` (a `K3Checkpoint`) needs besides the expert cache, serving `shape`."""
    from k3stream.gguf.layout import is_routed_expert

    routed = sum(t.nbytes for t in checkpoint.tensors.values() if is_routed_expert(t.name))
    total = sum(t.nbytes for t in checkpoint.tensors.values())
    return config_needs(checkpoint.config, routed, total - routed, shape)


# ---- the allocator ---------------------------------------------------------------------------------

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 64 << 10


def pin_malloc_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of `threshold` bytes and more with their own mmap, and keep it that way.

    glibc raises its mmap threshold each time such a block is freed, after which MiB-sized expert
    buffers come from the heap arenas of the reader threads and freed ones are not returned: measured on
    a 4 GB model, 430 MiB of resident memory above the expert budget after 12 decode steps (1745 MiB
    anonymous against 1315 MiB with the threshold pinned). Setting it explicitly turns the adjustment
    off. Returns False where there is no glibc `mallopt`."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def headroom_bytes(limit: int) -> int:
    """What the limit keeps beyond the planned terms, from its measured parts: the kernel's page tables
    and slab (KERNEL_SHARE of the limit) and the page cache of one uncached read with the folios
    around it (`gguf.uncached`: a load's non-expert reads; pack reads bypass the page cache). Measured
    in a child cgroup around `generate` on a real-dimension slice, the anonymous memory stayed under the
    other terms (allocations of 64 KiB and more are returned to the system, `pin_malloc_mmap_threshold`;
    the reader threads' stacks are a few pages each)."""
    from k3stream.gguf.uncached import CHUNK_BYTES, FOLIO_BYTES

    return math.ceil(limit * KERNEL_SHARE) + CHUNK_BYTES + 2 * FOLIO_BYTES


# ---- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    limit: int
    source: str
    runtime_bytes: int
    needs: ModelNeeds
    expert_budget: int
    cache_bytes: int = 0  # the prompt cache's RAM tier

    @property
    def headroom(self) -> int:
        return headroom_bytes(self.limit)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the expert cache."""
        n = self.needs
        resident = self.runtime_bytes + n.nonexpert_bytes + n.state_bytes + n.working_bytes
        return resident + self.headroom + self.cache_bytes

    def summary(self) -> str:
        n = self.needs
        return (
            f"memory limit {format_size(self.limit)} ({self.source}): runtime "
            f"{format_size(self.runtime_bytes)}, non-expert weights {format_size(n.nonexpert_bytes)}, "
            f"KV/state for {n.tokens} tokens{f' x {n.sequences} sequences' if n.sequences > 1 else ''} "
            f"{format_size(n.state_bytes)}, working buffers {format_size(n.working_bytes)} "
            f"(a prefill of {n.prefill_rows} rows), headroom "
            f"{format_size(self.headroom)}, prompt cache {format_size(self.cache_bytes)} -> expert RAM "
            f"budget {format_size(self.expert_budget)} "
            f"({self.expert_budget // max(n.object_bytes, 1)} experts of {n.object_bytes / MIB:.2f} MiB, "
            f"{self.expert_budget / max(n.expert_bytes, 1):.0%} of the routed experts)"
        )


def plan_memory(
    limit: int, needs: ModelNeeds, runtime_bytes: int, source: str = "--memory-limit", cache_bytes: int = 0
) -> MemoryPlan:
    """Split `limit`; raise `MemoryLimitError` (one line) when it cannot hold one top-k working set."""
    plan = MemoryPlan(limit, source, runtime_bytes, needs, 0, cache_bytes)
    room = limit - plan.fixed_bytes
    if room < needs.working_set:
        raise MemoryLimitError(
            f"memory limit {format_size(limit)} ({source}) cannot hold the runtime "
            f"({format_size(runtime_bytes)}), non-expert weights ({format_size(needs.nonexpert_bytes)}), "
            f"KV/state ({format_size(needs.state_bytes)}), working buffers "
            f"({format_size(needs.working_bytes)} for a prefill of {needs.prefill_rows} rows), headroom "
            f"({format_size(plan.headroom)}) and prompt cache ({format_size(cache_bytes)}) plus one "
            f"top-k working set ({needs.top_k} x {needs.object_bytes} bytes); it needs at least "
            f"{format_size(plan.fixed_bytes + needs.working_set)}"
            + (" (--cache-ram sets the prompt cache: 0 turns it off)" if cache_bytes else "")
        )
    budget = min(room, max(needs.expert_bytes, needs.working_set))
    return MemoryPlan(limit, source, runtime_bytes, needs, budget, cache_bytes)


def plan_for_model(
    checkpoint: K3Checkpoint, limit_text: str | None, shape: ServedShape = ServedShape(), cache_bytes: int = 0
) -> MemoryPlan:
    """The plan for an open checkpoint under `--memory-limit limit_text` (None: the cgroup's limit or
    available RAM), serving `shape`, `cache_bytes` of the limit the prompt cache's RAM tier."""
    if limit_text is None:
        limit, source = default_memory_limit()
    else:
        limit, source = parse_size(limit_text), "--memory-limit"
        _refuse_above_cgroup(limit)
    return plan_memory(limit, model_needs(checkpoint, shape), resident_bytes(), source, cache_bytes)


def _refuse_above_cgroup(limit: int) -> None:
    """`--memory-limit` (each rank's, under torchrun) above this process's memory cgroup limit plans
    memory the kernel never grants."""
    directory = own_memory_cgroup()
    granted = None if directory is None else cgroup_limit(directory)
    ranks = local_ranks()
    if granted is not None and limit * ranks > granted:
        each = f" for each of {ranks} ranks" if ranks > 1 else ""
        raise MemoryLimitError(
            f"--memory-limit {format_size(limit)}{each} is above the {format_size(granted)} limit of "
            f"cgroup {directory}; give at most {format_size(granted // ranks)}"
        )


def default_expert_ram_mib(
    checkpoint: K3Checkpoint, shape: ServedShape = ServedShape(), cache_bytes: int = 0
) -> float:
    """The expert budget (MiB) of the default plan for `checkpoint` (`plan_for_model`'s terms): 0 when
    that plan cannot hold one top-k working set."""
    try:
        return plan_for_model(checkpoint, None, shape, cache_bytes).expert_budget / MIB
    except MemoryLimitError:
        return 0.0
