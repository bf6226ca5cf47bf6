"""`LoadOptions`: everything a load takes besides the checkpoint (`k3stream.load(source, options)`).

No torch import here: the commands build one from their flags before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from k3stream.experts import ExpertSource

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint becomes a model.

    `device`: "cpu", "cuda" or "cuda:N". `kernels="auto"`: every matrix stays in its GGUF type and
    bytes, and products go through the kernel seam (`k3stream.quant.kernels`); `kernels="reference"`:
    the path the kernels are tested against: matrices dequantized to `dtype` at load (a `dtype` other
    than float32 needs it), or with `keep_quantized` kept in blocks and dequantized a slab at a time.
    `match_ggml` (default): CPU products compute as llama.cpp's CPU backend does: inputs of
    block-quantized matrices quantized to 8 bits a row (Q8_K, Q8_0 or Q8_1) and ggml's integer dot products,
    inputs of F16/BF16 matrices rounded to their type. It is the faster arithmetic on the CPU and the
    closer one to llama.cpp on a quantized file. `match_ggml=False`: float32 activations, dequantized
    weight tiles times unrounded inputs (the path the reference dequantizer is tested against; training
    takes it). Products on CUDA, and weights re-typed by `dtype`, take float32 activations either way
    (`ggml_arithmetic`).
    `profile="audited"` enforces the published recipe after loading.

    Routed experts come from `expert_source` (default: straight from the GGUF, all read into RAM at load
    when they fit in `expert_ram_mib`, else read at every step). `expert_ram_mib=None`: `k3stream.load`
    takes the budget the memory plan leaves (`k3stream.memlimit`), `model.k3.load` keeps none.
    `prefetch` sends the expert source the experts the next layers may need; `prefetch_hint` picks the
    prediction (`k3stream.model.hints`).

    `tp_rank`/`tp_size` load tensor-parallel rank `tp_rank` of `tp_size`: each KDA layer holds only that
    rank's heads, so its output is a partial sum to all-reduce over the ranks (`k3stream.engine.parallel`
    shards the whole model over a process group and reduces).
    """

    device: str = "cpu"
    dtype: str = "float32"
    kernels: str = "auto"
    match_ggml: bool = True
    keep_quantized: bool = False
    profile: str = "generic"
    expert_ram_mib: float | None = None
    expert_source: ExpertSource | None = None
    prefetch: bool = True
    prefetch_hint: str = "auto"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        from k3stream.gguf.profile import PROFILES
        from k3stream.model.hints import HINT_CHOICES
        from k3stream.quant.kernels import BACKENDS

        _choice("device", str(self.device).split(":")[0], ("cpu", "cuda"))
        _choice("dtype", self.dtype, DTYPES)
        _choice("kernels", self.kernels, BACKENDS)
        _choice("profile", self.profile, tuple(PROFILES))
        _choice("prefetch_hint", self.prefetch_hint, HINT_CHOICES)
        if self.kernels == "auto" and self.dtype != "float32":
            raise ValueError(f"LoadOptions.dtype {self.dtype} re-types weights: needs kernels='reference'")
        for name in ("match_ggml", "keep_quantized", "prefetch"):  # a truthy "no" must not turn one on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoadOptions.{name} must be True or False, got {getattr(self, name)!r}")
        ram = self.expert_ram_mib
        if ram is not None and not (isinstance(ram, Real) and not isinstance(ram, bool) and ram >= 0):
            raise ValueError(f"LoadOptions.expert_ram_mib must be >= 0 or None, got {self.expert_ram_mib!r}")
        if self.tp_size < 1:
            raise ValueError(f"LoadOptions.tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"LoadOptions.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def ggml_arithmetic(self) -> bool:
        """Whether products round their inputs as llama.cpp's CPU backend does: `match_ggml` on the CPU,
        matrices in their GGUF types (float32 `dtype`). On CUDA the Triton kernels take float32
        activations: rounding each input in torch first would only slow them, and llama.cpp's CUDA
        backend computes its own way. Weights re-typed by `dtype` are no longer ggml's types."""
        return self.match_ggml and self.device == "cpu" and self.dtype == "float32"

    @property
    def arithmetic(self) -> str:
        """What decides a model's computed bits beside its file: the product path, the arithmetic, the
        weights' dtype and the device (a prompt cache's snapshots are keyed to it)."""
        return (
            f"kernels={self.kernels} ggml={self.ggml_arithmetic} dtype={self.dtype} "
            f"keep_quantized={self.keep_quantized} device={str(self.device).split(':')[0]}"
        )

    @property
    def in_gguf_types(self) -> bool:
        """Whether matrices stay as GGUF bytes (rather than dense float tensors)."""
        return self.kernels == "auto" or self.keep_quantized


def _choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"LoadOptions.{field} must be one of {', '.join(choices)}, got {value!r}")
