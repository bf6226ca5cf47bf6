"""GGML type table: which types k3stream decodes, and their block geometry."""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QType = int | GGMLQuantizationType

T = GGMLQuantizationType
# F32, F16, BF16: tensors held as values (the one list of them); every other GGML type is quantized bytes
FLOAT_TYPE_IDS: tuple[GGMLQuantizationType, ...] = (T.F32, T.F16, T.BF16)
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset(FLOAT_TYPE_IDS)
# the i-quants (lookup grids, 1.56 to 4.25 bits a weight) and the ternary TQ1_0/TQ2_0
IQUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0}
)
# the types k3stream decodes but does not encode (nor does gguf): test models get random valid blocks
DECODE_ONLY_TYPES: frozenset[GGMLQuantizationType] = IQUANT_TYPES | frozenset({T.NVFP4})
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = (
    FLOAT_TYPES
    | frozenset(
        {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.NVFP4}
    )
    | IQUANT_TYPES
)


def _known(qtype: QType) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(int(qtype))
    except (TypeError, ValueError):
        raise ValueError(f"unknown GGML quantization type {qtype!r}") from None


def as_qtype(qtype: QType) -> GGMLQuantizationType:
    """The enum member for `qtype`; ValueError naming it when it is unknown or unsupported."""
    member = _known(qtype)
    if member not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise ValueError(
            f"GGML type {member.name} ({member.value}) is not supported by k3stream.quant "
            f"(supported: {supported})"
        )
    return member


def type_name(qtype: QType) -> str:
    """`"Q2_K"` for 10; any GGML type id known to gguf, supported or not."""
    return _known(qtype).name


def type_size(qtype: QType) -> tuple[int, int]:
    """`(elements per block, bytes per block)` of a supported type."""
    return GGML_QUANT_SIZES[as_qtype(qtype)]


def row_bytes(qtype: QType, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements; ValueError when `n_cols` is not whole blocks."""
    block_elems, block_bytes = type_size(qtype)
    if n_cols % block_elems:
        raise ValueError(
            f"row of {n_cols} elements is not a multiple of the {type_name(qtype)} block size {block_elems}"
        )
    return n_cols // block_elems * block_bytes
