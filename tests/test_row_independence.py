"""Every supported type, both arithmetics, every kernel ISA: a row's product through the kernel seam
(`qmatmul`, `Products`, `MLP`, `grouped_qmatmul`, `expert_mlp`) has the bits it has alone, whatever the
number of rows computed with it (1 to 64: both sides of every row-count threshold the seam has), so a
prefill's logits do not depend on how many tokens go in at once. F32 matrices hold it up to
F32_KERNEL_MAX_ROWS rows (a decode batch), and at any count under `set_row_exact` (what snapshots
need); above it their prefill takes torch's faster GEMM, which rounds as its row count has it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, NO_C_KERNELS, take_kernel_isa
from k3stream.quant import DECODE_ONLY_TYPES, SUPPORTED_TYPES, quantize
from k3stream.quant.kernels import (
    MLP,
    Products,
    QWeight,
    Situ,
    cpu,
    expert_mlp,
    grouped_qmatmul,
    qmatmul,
    seam,
)
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


def each_row_alone(product, x: torch.Tensor, counts: tuple[int, ...]) -> None:
    """product(x[:n]) for every n in counts: row by row the bits of product(that row)."""
    alone = torch.cat([product(row) for row in x.split(1)])
    for n in counts:
        together = product(x[:n])
        assert torch.equal(together, alone[:n]), f"{n} rows: rows differ from their one-row results"


@pytest.mark.parametrize("match_ggml", [True, False])
@pytest.mark.parametrize("qt", sorted(SUPPORTED_TYPES), ids=lambda t: T(t).name)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_a_rows_bits_do_not_depend_on_how_many_rows_go_in_at_once(qt, isa, match_ggml, monkeypatch):
    """Each supported type's rows as alone at 1 to 64 rows; F32's up to a decode batch's rows, and at
    any count under `set_row_exact`."""
    take_kernel_isa(isa, monkeypatch)
    if qt == T.F32:
        each_product_row_alone(qt, match_ggml, tuple(n for n in COUNTS if n <= seam.F32_KERNEL_MAX_ROWS))
        monkeypatch.setattr(seam._RowExact, "on", True)
    each_product_row_alone(qt, match_ggml, COUNTS)


def each_product_row_alone(qt: T, match_ggml: bool, counts: tuple[int, ...]) -> None:
    """Small matrices (an F32 one input-major in `Products`) and larger ones (row-major), one product,
    several fused, the one-call MLP, grouped experts: each row as alone at every count."""
    x = torch.randn(max(COUNTS), 512)
    small, large = weight(qt, 64, 512, 1), weight(qt, 288, 512, 2)
    each_row_alone(lambda rows: qmatmul(rows, large, match_ggml=match_ggml), x, counts)
    each_row_alone(Products([small], match_ggml=match_ggml), x, counts)
    each_row_alone(Products([large, small], match_ggml=match_ggml), x, counts)
    gate, up, down = (Products([weight(qt, 512, 512, s)], match_ggml=match_ggml) for s in (3, 4, 5))
    each_row_alone(MLP(gate, up, down, ACTIVATION), x, counts)
    experts = [Expert(*(weight(qt, 512, 512, 10 * e + s) for s in range(3))) for e in range(2)]

    def grouped(rows: torch.Tensor) -> torch.Tensor:
        """Every row through expert 0, then every row through expert 1: [2 N, 512] in that order."""
        n = len(rows)
        starts, order = torch.tensor([0, n, 2 * n]), torch.arange(n).repeat(2)
        out = expert_mlp(rows, experts, starts, order, ACTIVATION, match_ggml=match_ggml)
        first = grouped_qmatmul(rows, [e.up for e in experts], starts, order, match_ggml=match_ggml)
        return torch.cat([out, first], dim=1).view(2, n, -1).transpose(0, 1).reshape(n, -1)

    each_row_alone(grouped, x, counts)
