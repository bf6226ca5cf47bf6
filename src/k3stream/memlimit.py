"""Fit k3stream to the memory it has: the limit, what must stay resident, and the expert budget left.

`--memory-limit SIZE` (default: this process's memory cgroup limit, else the available RAM) is split as

    limit = runtime (interpreter + torch, measured) + non-expert weights (their GGUF bytes, held in
            anonymous memory) + KV/state + working buffers + headroom + prompt cache (`--cache-ram`)
            + expert RAM budget

and the expert budget must hold at least one top-k working set (top_k x one expert object); below that
the command refuses with one line. The budget is never larger than the pack's routed experts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint

MIB = 1 << 20
GIB = 1 << 30
UNLIMITED = 1 << 60  # cgroup v1 writes 2^63 - page size for "no limit"; anything this large is none
SIZING_TOKENS = 4096  # KV/state is sized for this many tokens (or the context length if shorter)
PREFILL_TOKENS = 256  # activations are sized for a prefill of this many tokens at once
HEADROOM_BYTES = 64 * MIB  # allocator slack, reads in flight, the pack's page cache between reads
SCRATCH_BYTES = 64 * MIB  # dequantisation slabs (16 MiB of float32 rows at a time) and friends
ACTIVATION_FACTOR = 16  # float32 activations alive per token, in units of max(hidden, latent, ff)

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
    """`(bytes, where from)`: the memory cgroup's limit, else the available RAM."""
    directory = own_memory_cgroup(proc, sys_cgroup)
    limit = None if directory is None else cgroup_limit(directory, sys_cgroup)
    if limit is not None:
        return limit, f"cgroup {directory}"
    return available_memory(proc), "available RAM"


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
    object_bytes: int
    top_k: int
    expert_bytes: int  # all routed experts (the pack's payload)
    tokens: int  # KV/state is sized for this many tokens

    @property
    def working_set(self) -> int:
        return self.top_k * self.object_bytes


def state_bytes(config: Any, tokens: int) -> int:
    """Float32 KV/state of one sequence of `tokens`: MLA latent cache, KDA recurrent and conv states."""
    per_mla = tokens * (config.kv_lora + config.qk_rope) * 4
    heads, dim = config.kda_heads, config.kda_head_dim
    per_kda = (heads * dim * dim + 3 * heads * dim * max(config.conv_kernel - 1, 0)) * 4
    banks = (config.n_layers // max(config.block_size, 1) + 2) * tokens * config.hidden * 4
    return len(config.mla_layers) * per_mla + len(config.kda_layers) * per_kda + banks


def working_bytes(config: Any, tokens: int, io_threads: int, object_bytes: int) -> int:
    """Activations of a prefill of `tokens` (at most PREFILL_TOKENS), logits of its last row, scratch,
    and reads in flight."""
    tokens = min(tokens, PREFILL_TOKENS)
    width = max(config.hidden, config.latent, config.expert_ff, config.dense_ff)
    activations = ACTIVATION_FACTOR * tokens * width * 4
    logits = 2 * config.vocab_size * 4
    return activations + logits + SCRATCH_BYTES + io_threads * object_bytes


def model_needs(checkpoint: Any, tokens: int = SIZING_TOKENS, io_threads: int = 4) -> ModelNeeds:
    """What `checkpoint` (a `K3Checkpoint`) needs besides the expert cache."""
    from k3stream.gguf.layout import is_routed_expert

    config = checkpoint.config
    tokens = min(tokens, config.context_length)
    routed = sum(t.nbytes for t in checkpoint.tensors.values() if is_routed_expert(t.name))
    total = sum(t.nbytes for t in checkpoint.tensors.values())
    objects = len(config.moe_layers) * config.n_experts
    object_bytes = math.ceil(routed / objects) if objects else 0
    return ModelNeeds(
        nonexpert_bytes=total - routed,
        state_bytes=state_bytes(config, tokens),
        working_bytes=working_bytes(config, tokens, io_threads, object_bytes),
        object_bytes=object_bytes,
        top_k=config.top_k,
        expert_bytes=routed,
        tokens=tokens,
    )


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
    def fixed_bytes(self) -> int:
        """Everything but the expert cache."""
        n = self.needs
        resident = self.runtime_bytes + n.nonexpert_bytes + n.state_bytes + n.working_bytes
        return resident + HEADROOM_BYTES + self.cache_bytes

    def summary(self) -> str:
        n = self.needs
        return (
            f"memory limit {format_size(self.limit)} ({self.source}): runtime "
            f"{format_size(self.runtime_bytes)}, non-expert weights {format_size(n.nonexpert_bytes)}, "
            f"KV/state for {n.tokens} tokens "
            f"{format_size(n.state_bytes)}, working buffers {format_size(n.working_bytes)}, headroom "
            f"{format_size(HEADROOM_BYTES)}, prompt cache {format_size(self.cache_bytes)} -> expert RAM "
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
            f"({format_size(needs.working_bytes)}), headroom ({format_size(HEADROOM_BYTES)}) and prompt "
            f"cache ({format_size(cache_bytes)}) plus one "
            f"top-k working set ({needs.top_k} x {needs.object_bytes} bytes); it needs at least "
            f"{format_size(plan.fixed_bytes + needs.working_set)}"
        )
    budget = min(room, max(needs.expert_bytes, needs.working_set))
    return MemoryPlan(limit, source, runtime_bytes, needs, budget, cache_bytes)


def plan_for_model(
    checkpoint: K3Checkpoint, limit_text: str | None, io_threads: int = 4, cache_bytes: int = 0
) -> MemoryPlan:
    """The plan for an open checkpoint under `--memory-limit limit_text` (None: the cgroup's limit or
    available RAM), `cache_bytes` of it the prompt cache's RAM tier."""
    if limit_text is None:
        limit, source = default_memory_limit()
    else:
        limit, source = parse_size(limit_text), "--memory-limit"
    needs = model_needs(checkpoint, io_threads=io_threads)
    return plan_memory(limit, needs, resident_bytes(), source, cache_bytes)


def default_expert_ram_mib(checkpoint: K3Checkpoint) -> float:
    """The expert budget (MiB) of the default plan for `checkpoint`: 0 when that plan cannot hold one
    top-k working set."""
    try:
        return plan_for_model(checkpoint, None).expert_budget / MIB
    except MemoryLimitError:
        return 0.0
