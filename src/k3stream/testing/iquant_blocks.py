"""Random valid blocks of the types k3stream decodes but cannot encode (the i-quants, the ternary
types, NVFP4), for the mixed recipes of `make-tiny --recipe` (`gguf.mixed_recipes`): random codes (every grid
index and sign pattern of the i-quants is valid, the ternary codes are drawn from -1, 0, 1) under one
fp16 scale that gives the decoded values the standard deviation `gguf.writer` gives its float weights.
"""

from __future__ import annotations

import numpy as np

_TERNARY_POWERS = np.array([81, 27, 9, 3, 1], dtype=np.int64)


def _ternary_bytes(trits: np.ndarray) -> np.ndarray:
    """TQ1_0 bytes of (..., k) trits 0..2, most significant first, as ggml packs them."""
    value = (trits.astype(np.int64) * _TERNARY_POWERS[-trits.shape[-1] :] * 3 ** (5 - trits.shape[-1])).sum(
        -1
    )
    return ((value * 256 + 242) // 243).astype(np.uint8)


def _tq1_0_codes(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    trits = rng.integers(0, 3, (n_blocks, 256), dtype=np.uint8)
    head = trits[:, :160].reshape(n_blocks, 5, 32).transpose(0, 2, 1)
    middle = trits[:, 160:240].reshape(n_blocks, 5, 16).transpose(0, 2, 1)
    tail = trits[:, 240:].reshape(n_blocks, 4, 4).transpose(0, 2, 1)
    return np.concatenate([_ternary_bytes(head), _ternary_bytes(middle), _ternary_bytes(tail)], axis=-1)


def _tq2_0_codes(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    trits = rng.integers(0, 3, (n_blocks, 2, 4, 32), dtype=np.uint8)
    shifted = trits << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(shifted, axis=2).reshape(n_blocks, 64)


def _set_scale(blocks: np.ndarray, type_name: str, d: float) -> None:
    """Write fp16 `d` as every block's super-scale."""
    if type_name == "NVFP4":  # four UE4M3 run scales, each decoded halved
        from gguf.quants import NVFP4

        blocks[:, :4] = NVFP4.fp32_to_ue4m3(np.float32(2 * d))
        return
    bits = int(np.float16(d).view(np.uint16))
    if type_name == "IQ1_M":  # the four nibbles top the last four 16-bit words
        words = blocks[:, 48:56].copy().view(np.uint16)
        nibbles = (bits >> np.array([0, 4, 8, 12])) & 0xF
        blocks[:, 48:56] = ((words & 0x0FFF) | (nibbles << 12).astype(np.uint16)).view(np.uint8)
        return
    offset = {"TQ1_0": 52, "TQ2_0": 64}.get(type_name, 0)
    blocks[:, offset : offset + 2] = np.frombuffer(np.uint16(bits).tobytes(), dtype=np.uint8)


def random_blocks(type_name: str, shape: tuple[int, ...], seed: list[int]) -> np.ndarray:
    """uint8 (*shape[:-1], row bytes): random valid `type_name` blocks whose decoded values have a
    standard deviation of about 1/sqrt(shape[-1])."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from k3stream.quant import dequantize

    qtype = GGMLQuantizationType[type_name]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_values
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if type_name == "TQ1_0":
        blocks[:, :52] = _tq1_0_codes(rng, n_blocks)
    elif type_name == "TQ2_0":
        blocks[:, :64] = _tq2_0_codes(rng, n_blocks)
    _set_scale(blocks, type_name, 1.0)
    spread = float(dequantize(blocks, qtype).square().mean().sqrt())
    _set_scale(blocks, type_name, 1.0 / np.sqrt(shape[-1]) / max(spread, 1e-3))
    return blocks.reshape(*shape[:-1], -1)
