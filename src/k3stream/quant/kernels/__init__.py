"""Products with GGUF-typed weights: the kernel seam (`seam`) over the C kernels (`cpu`) and the Triton
kernels (`gpu`). Every product with GGUF weights goes through the seam, and only there a kernel is picked.
"""

from . import cpu
from .seam import (
    BACKENDS,
    F32,
    MLP,
    ExpertMatrices,
    GroupedProduct,
    Products,
    QWeight,
    Situ,
    bind_chosen_experts,
    bind_experts_at,
    checked_weight,
    expert_mlp,
    grouped_qmatmul,
    kernel_for,
    note_fallbacks,
    qmatmul,
    row_at_a_time,
    row_exact,
    set_row_exact,
    situ,
    warm_up,
)

__all__ = [
    "BACKENDS",
    "F32",
    "MLP",
    "ExpertMatrices",
    "GroupedProduct",
    "Products",
    "QWeight",
    "Situ",
    "bind_chosen_experts",
    "bind_experts_at",
    "checked_weight",
    "cpu",
    "expert_mlp",
    "grouped_qmatmul",
    "kernel_for",
    "note_fallbacks",
    "qmatmul",
    "row_at_a_time",
    "row_exact",
    "set_row_exact",
    "situ",
    "warm_up",
]
