"""Feed-forward blocks: the dense MLP of the first layers and the latent MoE of the rest."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from k3stream.experts import ExpertSource, ExpertWeights, group_pairs
from k3stream.model.layers import JointLinear, Linear, QuantLinear, bind_linear, bind_rms_norm, rms_norm
from k3stream.quant.kernels import MLP, Situ, bind_chosen_experts, bind_experts_at, cpu, expert_mlp, situ

# a step is computed in about this many groups at least: each waits only for what has not arrived
# yet, and a smaller group costs a kernel call and a fetch (prefill steps have hundreds of experts)
GROUPS_PER_STEP = 8

# the routed experts' roles in the order the C calls take them
MLP_ROLES = ("gate", "up", "down")

# llama.cpp clamps the sum of the chosen weights from below before renormalising
MIN_WEIGHT_SUM = 6.103515625e-5


@functools.lru_cache(maxsize=16)
def _one_row_bounds(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`starts`/`rows` of `expert_mlp` for one row through `count` experts, one pair each."""
    return torch.arange(count + 1, dtype=torch.int64), torch.zeros(count, dtype=torch.int64)


@dataclass
class SituMLP:
    """down(situ(gate(x), up(x))): the dense layers and the shared experts."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    beta: float
    linear_beta: float

    def __post_init__(self) -> None:
        # GGUF-typed layers on the kernels' path: one kernel call (`kernels.MLP`)
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        self._fused = (
            MLP(*(linear.products for linear in linears), Situ(self.beta, self.linear_beta))
            if all(isinstance(linear, QuantLinear) for linear in linears)
            else None
        )

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and h.dtype == torch.float32:
            return self._fused(h)
        activated = situ(self.gate_proj(h).float(), self.up_proj(h).float(), self.beta, self.linear_beta)
        return self.down_proj(activated)

    def bind(self, h: torch.Tensor, out: torch.Tensor, threads: int) -> cpu.Call:
        """The MLP of h into `out` as one bound C call, or a Python step calling it where it is not one."""
        call = (
            self._fused.bind(h, out, threads)
            if self._fused is not None and h.dtype == torch.float32
            else None
        )
        return call or cpu.python_step(lambda: out.copy_(self(h)))


@dataclass
class HeldStep:
    """A one-row step's routed experts as a source holds them: `ids` (the chosen, a view of the routing's
    output), their objects' addresses (`objects`, what `experts_at` reads) and whether the routing's
    step held them (`early`)."""

    ids: np.ndarray
    objects: np.ndarray
    early: bool = False


@dataclass
class MoEWeights:
    router: Linear  # E -> X
    correction_bias: torch.Tensor  # [X]
    routed_down: Linear  # E -> latent
    routed_up: Linear  # latent -> E
    routed_norm: torch.Tensor | None
    shared: SituMLP | None


@dataclass(frozen=True)
class Routing:
    top_k: int
    normalize: bool
    scale: float

    def choose(self, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [N, k] and their weights [N, k] from the router's logits [N, X]: sigmoid scores, the
        bias only picks (in C for float32 CPU tensors outside autograd)."""
        if logits.dim() == 2 and bias.shape == logits.shape[1:] and cpu.takes((logits, bias)):
            return cpu.route(logits, bias, self.top_k, self.normalize, MIN_WEIGHT_SUM, self.scale)
        probs = torch.sigmoid(logits)
        chosen = torch.topk(probs + bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.normalize:
            total = weights.double().sum(-1, keepdim=True).float()  # ggml's sum_rows: in double
            weights = weights / total.clamp_min(MIN_WEIGHT_SUM)
        return chosen, weights * self.scale


def by_votes(chosen: torch.Tensor) -> list[int]:
    """The experts in `chosen` [N, k], those most rows chose first (ties in id order)."""
    votes = torch.bincount(chosen.flatten().cpu())
    picked = votes.nonzero().flatten()
    order = torch.sort(-votes[picked], stable=True).indices
    return picked[order].tolist()


class LatentMoE:
    """Route in full width, run the routed experts in the latent space, add the shared experts."""

    def __init__(
        self,
        layer: int,
        weights: MoEWeights,
        source: ExpertSource,
        routing: Routing,
        beta: float,
        linear_beta: float,
        eps: float,
        match_ggml: bool = False,
        backend: str = "auto",
    ) -> None:
        self.layer = layer
        self.w = weights
        self.source = source
        self.routing = routing
        self.activation = Situ(beta, linear_beta)
        self.eps = eps
        self.match_ggml = match_ggml
        self.backend = backend
        # (latent [N, L], chosen [N, k]) -> the [N * k, L] pair outputs; expert parallelism
        # (`k3stream.engine.parallel.experts`) wraps it to run only its rank's experts and exchange the rest
        self.routed_pairs = self._routed_pairs
        self.chosen = torch.empty(0, routing.top_k, dtype=torch.long)
        self._asked: list[int] = []  # the experts __call__ read ahead for the step `routed_pairs` runs
        # the router and the routed down projection both take the layer input: one kernel call
        self.projections = JointLinear([weights.router, weights.routed_down])
        self._bound = threading.local()  # each thread's bound one-row step (`_decode_bound`)

    def predict(self, h: torch.Tensor) -> list[int]:
        """The experts this layer would pick for rows h (the prefetch hint), those most rows pick first
        (ties in id order): a source that reads only part of a hint reads the likeliest."""
        return by_votes(self.ranked(h))

    def ranked(self, h: torch.Tensor) -> torch.Tensor:
        """The experts this layer would pick for rows h [N, k], each row's by descending router score."""
        chosen, _ = self.routing.choose(self.w.router(h).float(), self.w.correction_bias)
        return chosen

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, E] -> [N, E]; the union of the experts all rows chose, fetched once each. One row on the
        C kernels takes the bound decode steps (`_decode_bound`, the same values)."""
        if h.shape[0] == 1 and self.backend == "auto" and cpu.takes((h,)) and self._routes_in_c():
            return self._decode_bound(h)
        logits, latent = (part.float().contiguous() for part in self.projections.parts(h))
        chosen, weights = self.routing.choose(logits, self.w.correction_bias)
        self._start_step(chosen)
        shared = self.w.shared(h).float() if self.w.shared is not None else None
        routed = self._routed_sum(latent, chosen, weights)
        if self.w.routed_norm is not None:
            routed = rms_norm(routed, self.w.routed_norm, self.eps)
        out = self.w.routed_up(routed).float()
        return out if shared is None else out + shared

    def unbind(self) -> None:
        """Drops the bound decode steps (every thread's): the next one-row call binds them again, to the
        C library's functions as they are then (a profile wraps them)."""
        self._bound = threading.local()

    def _decode_bound(self, h: torch.Tensor) -> torch.Tensor:
        """`__call__` of one row by the decode steps bound once per thread (again for another thread
        count) to buffers of their own, the shared experts called between the routing and the routed
        experts as `__call__` calls them (a source reading ahead reads while they compute)."""
        threads, bound = torch.get_num_threads(), self._bound
        if getattr(bound, "threads", None) != threads:
            bound.h, bound.routed = torch.empty_like(h), torch.empty_like(h)
            bound.routing, bound.routed_steps, bound.chosen = self._step_parts(bound.h, bound.routed, threads)
            bound.threads = threads
        bound.h.copy_(h)
        cpu.run_calls(bound.routing)
        shared = self.w.shared(h).float() if self.w.shared is not None else None
        cpu.run_calls(bound.routed_steps)
        self.chosen = bound.chosen.clone()
        return bound.routed.clone() if shared is None else bound.routed + shared

    def _routes_in_c(self) -> bool:
        """Whether the router of a one-row step runs in C (`cpu.bind_route`)."""
        bias = self.w.correction_bias
        return (
            type(self.routing) is Routing
            and (self.projections.widths[0],) == tuple(bias.shape)
            and cpu.takes((bias,))
        )

    def decode_parts(
        self, h: torch.Tensor, out: torch.Tensor, threads: int
    ) -> list[tuple[object, list[cpu.Call]]]:
        """`__call__` of one row (h [1, E] into out [1, E]) as C calls bound to buffers of their own, and
        Python steps only where the work is Python's: a reading-ahead source's start (`_start_step`),
        routed experts not all in RAM (fetched and summed by `_routed_sum`), or the whole layer where its
        router would not run in C. In step order, each run of steps with the part it is the work of:
        this layer, or its shared experts (`w.shared`)."""
        if not self._routes_in_c():
            return [(self, [cpu.python_step(lambda: out.copy_(self(h)))])]
        shared = None if self.w.shared is None else torch.empty_like(out)
        up = out if shared is None else torch.empty_like(out)
        routing, routed, _ = self._step_parts(h, up, threads)
        if shared is None:
            return [(self, routing + routed)]
        return [
            (self, routing),
            (self.w.shared, [self.w.shared.bind(h, shared, threads)]),
            (self, [*routed, cpu.bind_add(up, shared, out)]),
        ]

    def _step_parts(
        self, h: torch.Tensor, out: torch.Tensor, threads: int
    ) -> tuple[list[cpu.Call], list[cpu.Call], torch.Tensor]:
        """A one-row step's routing (the joint projection, the router, a reading-ahead source's start)
        and its routed part (the routed experts, their norm and up projection into `out` [1, E]) as bound
        steps, and the buffer the routing writes the chosen experts [1, k] to."""
        w, routing = self.w, self.routing
        joint = h.new_empty(1, sum(self.projections.widths))
        logits, latent = joint.split(self.projections.widths, dim=1)
        chosen, weights = torch.empty(1, routing.top_k, dtype=torch.int64), h.new_empty(1, routing.top_k)
        how = (routing.top_k, routing.normalize, MIN_WEIGHT_SUM, routing.scale)
        head = [
            bind_linear(self.projections, h, joint, threads),
            cpu.bind_route(logits, w.correction_bias, how, chosen, weights),
        ]
        routed = h.new_empty(latent.shape)
        tail, held = self._routed_steps(latent, chosen, weights, routed, threads)
        if self.source.reads_ahead or self.source.prefetches:  # reads start while the shared expert
            # computes; `chosen` is kept for the hints' scoring
            start = self._start_step if held is None else functools.partial(self._start_held, held)
            head.append(cpu.python_step(lambda: start(chosen)))
        normed = routed
        if w.routed_norm is not None:
            normed = torch.empty_like(routed)
            tail.append(bind_rms_norm(routed, w.routed_norm, self.eps, normed))
        tail.append(bind_linear(w.routed_up, normed, out, threads))
        return head, tail, chosen

    def _routed_steps(
        self,
        latent: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        threads: int,
    ) -> tuple[list[cpu.Call], HeldStep | None]:
        """A one-row step's routed experts summed into `out`: from a source holding all the layer's
        experts in RAM (`resident`), the chosen experts' MLP in one C call on their addresses, then the
        weighted sum; from one that holds a step's experts (`hold`), a Python step holding them, then
        one C call (their MLP and sum), with the step they are held for (the routing's step may hold
        them first: `_start_held`); else a Python step (`_routed_sum`: the fetch, then the same
        products and sum)."""
        pairs = latent.new_empty(chosen.shape[1], latent.shape[1])
        summed = cpu.python_step(lambda: self._routed_sum(latent, chosen, weights, out))
        if self.routed_pairs != self._routed_pairs:  # expert parallelism: an exchange computes them
            return [summed], None
        resident = self.source.resident(self.layer)
        if resident is not None:
            roles = [(r.data, r.nbytes, r.ggml_type, r.shape) for r in (resident[n] for n in MLP_ROLES)]
            how = (self.activation, pairs, threads, self.match_ggml, self.backend)
            call = bind_chosen_experts(latent, chosen, roles, *how)
            return ([summed] if call is None else [call, cpu.bind_combine(pairs, weights, out)]), None
        placed = self.source.object_roles(self.layer)
        objects = np.empty(chosen.shape[1], dtype=np.int64)
        call = None
        if placed is not None:
            roles = [(r.offset, r.ggml_type, r.shape) for r in (placed[n] for n in MLP_ROLES)]
            sums = (pairs, weights, out)
            how = (threads, self.match_ggml, self.backend)
            call = bind_experts_at(latent, torch.from_numpy(objects), roles, self.activation, *sums, *how)
        if call is None:
            return [summed], None
        held = HeldStep(chosen[0].numpy(), objects)
        return [cpu.python_step(lambda: self._hold_or_sum(held, summed)), call], held

    def _start_held(self, held: HeldStep, chosen: torch.Tensor) -> None:
        """The routing's Python step of a one-row step whose experts the source holds: where all of them
        are in RAM, held at once (one store call: nothing to read ahead, `_hold_or_sum` has nothing
        left to do); else `_start_step` (their reads start)."""
        self.chosen = chosen
        held.early = self.source.hold(self.layer, held.ids.tolist(), held.objects)
        if held.early:
            self._asked = []
        else:
            self._start_step(chosen)

    def _hold_or_sum(self, held: HeldStep, summed: cpu.Call) -> None:
        """A one-row step's routed experts held by the source for the C call that follows (`experts_at`
        on their `objects`, pinned until this thread's next fetch; already held where the routing's
        step held them), or, where some are not in RAM, summed here (`summed`: their reads awaited group
        by group) and `objects[0]` zeroed (the call then does nothing). NumPy and C only: a torch
        operation costs tens of microseconds once a token's weight reads evicted its code."""
        if held.early:
            return
        if self.source.hold(self.layer, held.ids.tolist(), held.objects):
            self._asked = []  # what __call__ read ahead: all of it resident, held here
        else:
            held.objects[0] = 0
            cpu.run_calls([summed])

    def _start_step(self, chosen: torch.Tensor) -> None:
        """Keep the step's choices [N, k] (for whoever scores predictions of them); a source that reads
        ahead starts on the first window, read while the shared expert computes."""
        self.chosen = chosen
        if self.source.reads_ahead:
            # tolist, not flatten: no torch operation (tens of microseconds once reads evicted torch's code)
            order, resident = self._step_order(
                sorted({expert for row in chosen.tolist() for expert in row}), []
            )
            self._asked = order[: resident + self._read_window(len(order))]
            self.source.read_ahead(self.layer, self._asked)

    def _routed_sum(
        self,
        latent: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's expert outputs summed by their weights [N, latent] (into `out` when given)."""
        pairs = self.routed_pairs(latent, chosen)
        if cpu.takes((pairs, weights)):
            return cpu.combine(pairs, weights, out)
        summed = (pairs.view(*chosen.shape, -1) * weights[..., None]).sum(1)
        return summed if out is None else out.copy_(summed)

    def _routed_pairs(self, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The expert output of every (row, choice) pair, [N * k, latent].

        The step's experts are fetched in groups of at most `max_experts_per_fetch`: first those
        already resident (`_step_order`), then, from a source that reads ahead, whichever have arrived,
        topped up in order to an eighth of the step (`_next_group`), so each expert is computed soon
        after it is read. A pair's output depends only on its row and its expert (the kernel computes
        each output on its own), so a streamed run equals an all-resident run bit for bit at any cache
        size and in any arrival order. A one-row step of distinct experts from a source that serves
        them at once (a decode token) skips the grouping's bookkeeping (`_one_row_pairs`).
        """
        experts = chosen[0].tolist() if chosen.shape[0] == 1 else []
        if len(set(experts)) == len(experts) > 0 and self._serves_at_once(experts):
            return self._one_row_pairs(latent, experts)
        return self._grouped_pairs(latent, chosen)

    def _serves_at_once(self, experts: list[int]) -> bool:
        """Whether the source serves these experts in one fetch with nothing to wait for: within its
        fetch limit, and it reads nothing ahead or holds all of them in RAM (a resident decode token
        from the expert store: its grouping's bookkeeping cost ~0.3 ms a MoE layer)."""
        count = len(experts)
        if (self.source.max_experts_per_fetch or count) < count:
            return False
        return not self.source.reads_ahead or len(self.source.ready(self.layer, experts)) == count

    def _one_row_pairs(self, latent: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """A one-row step (a decode token) of distinct experts from a source that serves it at once:
        what `_grouped_pairs` does then (one fetch in pack order, computed in the order of choice),
        without its bookkeeping."""
        self._asked = []  # what __call__ read ahead: all of it resident, fetched here
        fetched = self.source.fetch(self.layer, sorted(experts))
        starts, rows = _one_row_bounds(len(experts))
        weights = [fetched[expert] for expert in experts]
        return expert_mlp(latent, weights, starts, rows, self.activation, self.match_ggml, self.backend)

    def _grouped_pairs(self, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """`_routed_pairs` of any step: its experts fetched and computed group by group."""
        pairs_of = _pairs_by_expert(chosen)
        ids = list(pairs_of)
        # what __call__ read ahead (of this step's experts: an expert-parallel rank computes its own)
        read_before = [expert for expert in self._asked if expert in pairs_of]
        self._asked = []
        order, leading = self._step_order(ids, read_before)
        rank = {expert: i for i, expert in enumerate(order)}
        window = self._read_window(len(ids))
        least = -(-len(ids) // GROUPS_PER_STEP)
        read = len(ids)  # how many of `order` were asked for
        if self.source.reads_ahead:  # those __call__ asked for, the others resident now, and at least
            # a window: __call__'s window covers the whole step, which an expert-parallel rank's share
            # of it may lie beyond (then nothing of this rank's was asked for)
            read = self._slide_window(order, len(read_before), max(leading, window))
        ahead = self._read_ahead_count(leading, window, least)
        # a streamed step's groups hold at most `group_pairs` pairs' products; from a source without a
        # fetch limit (every expert in RAM) the step is one group, one kernel call
        cap = chosen.numel() if self.source.max_experts_per_fetch is None else group_pairs(*chosen.shape)
        pending = order
        joined: torch.Tensor | None = None  # every pair's output, in pair order
        while pending:
            asked = [expert for expert in pending if rank[expert] < read]
            # while some of the step is not yet asked for, small groups: each one computed lets the
            # reads slide on (one large group of what arrived would leave the disk idle behind it)
            group = self._next_group(pending, asked, least, most=least if read < len(order) else None)
            group = _within_pairs(group, pairs_of, cap)
            experts = self.source.fetch(self.layer, group)
            pending = [expert for expert in pending if expert not in experts]
            read = self._slide_window(order, read, len(ids) - len(pending) + ahead)
            pairs, computed = self._compute_group(latent, experts, group, pairs_of, chosen.shape[1])
            # the group's views die before the next fetch evicts its experts: their buffers are then
            # the ones that fetch's reads reuse, not new ones beside the store's budget
            del experts
            if (
                joined is None
                and len(pairs) == chosen.numel()
                and np.array_equal(pairs, np.arange(len(pairs)))
            ):
                return computed  # the whole step in one group, in pair order
            if joined is None:  # each group's outputs copied in and dropped: a prefill pass's largest
                # buffer (`memlimit.ffn_floats`) held once, not as the groups, their join and its reorder
                joined = computed.new_empty(chosen.numel(), computed.shape[1])
            joined.index_copy_(0, torch.from_numpy(pairs).to(computed.device), computed)
            del computed  # not alive beside the next group's
        return joined

    def _compute_group(
        self,
        latent: torch.Tensor,
        experts: dict[int, ExpertWeights],
        group: list[int],
        pairs_of: dict[int, np.ndarray],
        top_k: int,
    ) -> tuple[np.ndarray, torch.Tensor]:
        """The pairs of the fetched `group` and their outputs [pairs, latent] (in that order), taken in
        the order of their first pairs (so one row's step, computed in one group, needs no reorder)."""
        in_order = sorted(group, key=lambda expert: pairs_of[expert][0])
        pairs = np.concatenate([pairs_of[expert] for expert in in_order])
        counts = np.cumsum([len(pairs_of[expert]) for expert in in_order])
        # starts, then rows
        bounds = torch.from_numpy(np.concatenate(([0], counts, pairs // top_k)).astype(np.int64))
        starts, rows = bounds[: len(group) + 1], bounds[len(group) + 1 :]
        weights = [experts[expert] for expert in in_order]
        return pairs, expert_mlp(
            latent, weights, starts, rows, self.activation, self.match_ggml, self.backend
        )

    def _step_order(self, ids: list[int], asked: list[int]) -> tuple[list[int], int]:
        """The step's experts (`ids`, in pack order) in the order they are fetched, and how many lead
        it that were asked for or are resident: first those already read ahead (`asked`, in that
        order), then those resident (they cost no read, and fetching them first pins them before
        this step's reads evict them: in a step larger than the cache, a layer's experts not yet used
        are the cheapest to evict), then the rest in pack order."""
        taken = set(asked)
        rest = [expert for expert in ids if expert not in taken]
        resident = self.source.ready(self.layer, rest)
        held = set(resident)
        order = asked + resident + [expert for expert in rest if expert not in held]
        return order, len(asked) + len(resident)

    def _read_window(self, count: int) -> int:
        """Experts read ahead of the computing: the whole step when the source has no cache or the
        step fits in half its slots (so what is computed and what is read both fit); a larger step
        streams through the cache and reads one group ahead of the one computing, so the slots it
        does not need keep experts for the next steps (else such steps evict every layer's experts
        at every step)."""
        slots = self.source.max_experts_per_fetch
        if slots is None or count <= slots // 2:
            return count
        return max(1, min(slots // 2, -(-count // GROUPS_PER_STEP)))

    def _read_ahead_count(self, leading: int, window: int, least: int) -> int:
        """How many of a step's experts are asked for beyond those computed: a window, or as many as
        led the step (read ahead or resident when it started), at most half the slots and what fits
        beside a group computing, so a step that starts on experts already in RAM reads on while it
        computes them, and the slots it leaves keep other layers' experts (a warm prefill's first
        step starting on 40 of 63 slots would otherwise evict the last layer's, `docs/store.md`)."""
        slots = self.source.max_experts_per_fetch
        return max(window, leading if slots is None else min(leading, slots // 2, slots - least))

    def _slide_window(self, order: list[int], read: int, end: int) -> int:
        """Read ahead the step's experts `order[read:end]` (`read`: how many were asked for so far);
        returns the new count."""
        end = min(len(order), end)
        if not self.source.reads_ahead or end <= read:
            return read
        self.source.read_ahead(self.layer, order[read:end])
        return end

    def _next_group(
        self, pending: list[int], asked: list[int], least: int, most: int | None = None
    ) -> list[int]:
        """The next fetch, at most a cache's worth of `pending` (and at most `most`): in order from a
        source that reads nothing ahead; else what has arrived of those read ahead (`asked`), topped up
        in order to `least` (the wait for those is the only stall)."""
        slots = min(self.source.max_experts_per_fetch or len(pending), most or len(pending))
        if not self.source.reads_ahead:
            return pending[:slots]
        group = self.source.ready(self.layer, asked)[:slots]
        if len(group) < least:
            arrived = set(group)
            group += [expert for expert in asked if expert not in arrived][: min(least, slots) - len(group)]
        return group or asked[:1]


def _within_pairs(group: list[int], pairs_of: dict[int, np.ndarray], cap: int) -> list[int]:
    """The leading experts of `group` whose pairs number at most `cap`, the first always (`cap` is at
    least one expert's pairs: `group_pairs`)."""
    total = 0
    for count, expert in enumerate(group):
        total += len(pairs_of[expert])
        if total > cap and count:
            return group[:count]
    return group


def _pairs_by_expert(chosen: torch.Tensor) -> dict[int, np.ndarray]:
    """A step's pairs (row * k + choice, for chosen [N, k]) by the expert they chose: each expert's in
    pair order, the experts in ascending id (one sort, not a Python loop over the pairs: a long
    prompt's step has tens of thousands)."""
    flat = chosen.flatten().cpu().numpy()
    order = np.argsort(flat, kind="stable")
    ids, firsts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    return {
        expert: order[first : first + count]
        for expert, first, count in zip(ids.tolist(), firsts.tolist(), counts.tolist(), strict=True)
    }
