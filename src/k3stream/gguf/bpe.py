"""The alphabet GGUF BPE vocabularies are written in: GPT-2's reversible map from bytes to printable
unicode characters (the tokenizer reads tokens back to bytes with it, the tiny vocabularies spell them)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
