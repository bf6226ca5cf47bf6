"""llama.cpp's logits for given token ids (F32 KV cache), computed in a child process.

llama.cpp may abort the whole process on a model it rejects, so the oracle runs apart from pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT = """
import json, sys
import numpy as np
import llama_cpp
jobs, out = json.loads(sys.argv[1]), sys.argv[2]
arrays = {}
for i, (path, tokens, n_batch, n_threads) in enumerate(jobs):
    model = llama_cpp.Llama(model_path=path, logits_all=True, type_k=0, type_v=0, n_ctx=max(64, len(tokens)),
                            n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads, verbose=False)
    model.eval(tokens)
    arrays[str(i)] = np.asarray(model.scores[: len(tokens)], dtype=np.float32)
    model.close()
np.savez(out, **arrays)
"""


def llama_logits(
    jobs: list[tuple[Path, list[int]]], out_dir: Path, n_batch: int = 512, n_threads: int = 1
) -> list[np.ndarray]:
    """[T, vocab] logits per `(model path, token ids)`; `n_batch=1` evaluates token by token."""
    argument = json.dumps(
        [(str(path), [int(t) for t in tokens], n_batch, n_threads) for path, tokens in jobs]
    )
    out = Path(out_dir) / "llama_logits.npz"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, argument, str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"llama.cpp failed: {done.stderr[-2000:]}"
    with np.load(out) as arrays:
        return [arrays[str(i)] for i in range(len(jobs))]


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


# router scores closer than this between the k-th and the next expert: two correct float orders of the
# same sums (llama.cpp's and ours differ by ~1e-6) may pick either expert, and the logits then part
ROUTING_TIE = 1e-5


@contextmanager
def _routing_margins(margins: list[float]) -> Iterator[None]:
    """Records each routing's smallest gap between the chosen k-th score and the next; the choice itself
    is the model's own (`Routing.choose`, called unchanged)."""
    import torch

    from k3stream.model import moe

    choose = moe.Routing.choose

    def recording(self: Any, logits: Any, bias: Any) -> Any:
        if self.top_k < logits.shape[-1]:
            ranked = torch.topk(torch.sigmoid(logits.float()) + bias, self.top_k + 1, dim=-1).values
            margins.append(float((ranked[..., -2] - ranked[..., -1]).min()))
        return choose(self, logits, bias)

    moe.Routing.choose = recording
    try:
        yield
    finally:
        moe.Routing.choose = choose


def routes_near_a_tie(model: Any, tokens: list[int]) -> bool:
    """Whether the prefill of `tokens` routes some row where two experts' scores are within ROUTING_TIE
    (a drawn model hypothesis then replaces: no float order decides such a choice)."""
    margins: list[float] = []
    with _routing_margins(margins):
        model.logits(tokens)
    return min(margins, default=1.0) < ROUTING_TIE
