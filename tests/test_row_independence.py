"""Every supported type, both arithmetics, every kernel ISA: a row's product through the kernel seam
(`qmatmul`, `Products`, `MLP`, `grouped_qmatmul`, `expert_mlp`) has the bits it has alone, whatever the
number of rows computed with it (1 to 64: both sides of every row-count threshold the seam has had),
so a prefill's logits do not depend on how many tokens go in at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, NO_C_KERNELS, take_kernel_isa
from k3stream.quant import DECODE_ONLY_TYPES, SUPPORTED_TYPES, quantize
from k3stream.quant.kernels import MLP, Products, QWeight, Situ, cpu, expert_mlp, grouped_qmatmul, qmatmul
from k3stream.testing import ggml_oracle

pytestmark = pytest.mark.skipif(not cpu.available(), reason=NO_C_KERNELS or "the C kernels are not built")

COUNTS = (1, 16, 17, 32, 33, 64)
ACTIVATION = Situ(1.5, 4.0)


def weight(qt: T, out: int, cols: int, seed: int) -> QWeight:
    """Random valid blocks of a type k3stream only decodes, else a random matrix quantized to qt."""
    rng = np.random.default_rng(seed)
    if qt in DECODE_ONLY_TYPES:
        data = ggml_oracle.random_blocks(int(qt), out * cols // GGML_QUANT_SIZES[qt][0], rng)
    else:
        data = quantize(rng.standard_normal((out, cols)).astype(np.float32) * 0.1, qt)
    return QWeight(torch.from_numpy(np.ascontiguousarray(data).reshape(-1)), int(qt), (out, cols))


@dataclass
class Expert:
    gate: QWeight
    up: QWeight
    down: QWeight


def each_row_alone(product, x: torch.Tensor) -> None:
    """product(x[:n]) for every n in COUNTS: row by row the bits of product(that row)."""
    alone = torch.cat([product(row) for row in x.split(1)])
    for n in COUNTS:
        together = product(x[:n])
        assert torch.equal(together, alone[:n]), f"{n} rows: rows differ from their one-row results"


@pytest.mark.parametrize("match_ggml", [True, False])
@pytest.mark.parametrize("qt", sorted(SUPPORTED_TYPES), ids=lambda t: T(t).name)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_a_rows_bits_do_not_depend_on_how_many_rows_go_in_at_once(qt, isa, match_ggml, monkeypatch):
    """Small matrices (an F32 one input-major in `Products`) and larger ones (row-major), one product,
    several fused, the one-call MLP, grouped experts: each row as alone at 1 to 64 rows."""
    take_kernel_isa(isa, monkeypatch)
    x = torch.randn(max(COUNTS), 512)
    small, large = weight(qt, 64, 512, 1), weight(qt, 288, 512, 2)
    each_row_alone(lambda rows: qmatmul(rows, large, match_ggml=match_ggml), x)
    each_row_alone(Products([small], match_ggml=match_ggml), x)
    each_row_alone(Products([large, small], match_ggml=match_ggml), x)
    gate, up, down = (Products([weight(qt, 512, 512, s)], match_ggml=match_ggml) for s in (3, 4, 5))
    each_row_alone(MLP(gate, up, down, ACTIVATION), x)
    experts = [Expert(*(weight(qt, 512, 512, 10 * e + s) for s in range(3))) for e in range(2)]

    def grouped(rows: torch.Tensor) -> torch.Tensor:
        """Every row through expert 0, then every row through expert 1: [2 N, 512] in that order."""
        n = len(rows)
        starts, order = torch.tensor([0, n, 2 * n]), torch.arange(n).repeat(2)
        out = expert_mlp(rows, experts, starts, order, ACTIVATION, match_ggml=match_ggml)
        first = grouped_qmatmul(rows, [e.up for e in experts], starts, order, match_ggml=match_ggml)
        return torch.cat([out, first], dim=1).view(2, n, -1).transpose(0, 1).reshape(n, -1)

    each_row_alone(grouped, x)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_f32_rows_are_their_decode_steps_at_any_row_count(isa, threads, monkeypatch):
    """Row-major F32 products of many rows (`f32_gemm.c`: tiles of two input rows by six weight rows,
    1,024 values of the weight rows at a time, the input rows about 1 MiB at a time): rows of 2,080
    values (two whole value blocks and part of one), 1,031 outputs (off the tile's six), more input rows
    than one input block, and a grouped product's rows out of order: every row bit for bit its one-row
    (decode) result, on one thread and two."""
    take_kernel_isa(isa, monkeypatch)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(130, 2080)
        large = weight(T.F32, 1031, 2080, 7)
        alone = torch.cat([qmatmul(row, large) for row in x.split(1)])
        for n in (2, 3, 7, 64, 127, 130):
            assert torch.equal(qmatmul(x[:n], large), alone[:n]), f"{n} rows"
        others = weight(T.F32, 1031, 2080, 8)
        order = torch.randperm(130)
        starts = torch.tensor([0, 61, 130])
        grouped = grouped_qmatmul(x, [large, others], starts, order)
        assert torch.equal(grouped[:61], alone[order[:61]])
        assert torch.equal(grouped[61:], torch.cat([qmatmul(x[i], others)[None] for i in order[61:]]))
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("recipe", ["ternary", "iq2_xxs", "f32"])
def test_a_prefills_logits_do_not_depend_on_how_many_tokens_go_in_at_once(tiny_model, recipe):
    """Perplexity's `--batch`: a prompt prefilled in pieces of 1 to 64 tokens (one: its decode steps)
    gives every row the same logits bit for bit, by default (no `set_row_exact`): every product
    row-exact, and MLA's queries (four heads) attending in C as their decode steps do."""
    from k3stream.engine.loading import load_runtime
    from k3stream.engine.perplexity import chunk_logits

    model = load_runtime(tiny_model(recipe=recipe, hidden=256, latent=256, expert_ff=256)).model
    ids = list(range(5, 5 + max(COUNTS)))
    whole = chunk_logits(model, ids, 0, max(COUNTS))
    for pieces in COUNTS[:-1]:
        assert torch.equal(chunk_logits(model, ids, 0, pieces), whole), f"pieces of {pieces} tokens"
