"""llama.cpp (via llama-cpp-python) as the logits and tokenizer oracle, run in a child process.

llama.cpp can abort the whole process on a bad model, so each call runs its jobs in one child.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

LLAMA_SCRIPT = """
import json, sys
import numpy as np
import llama_cpp
results = []
for path, prompt in json.loads(sys.argv[1]):
    model = llama_cpp.Llama(model_path=path, logits_all=True, type_k=0, type_v=0, n_ctx=128, verbose=False)
    tokens = model.tokenize(prompt.encode(), add_bos=False, special=True)
    model.eval(tokens)
    results.append({"tokens": tokens, "logits": np.asarray(model.scores[: len(tokens)]).tolist()})
    model.close()
print(json.dumps(results))
"""


def llama_runs(*jobs: tuple[object, str]) -> list[tuple[list[int], np.ndarray]]:
    """llama.cpp's tokens and logits (F32 KV cache) for each `(model path, prompt)`."""
    argument = json.dumps([(str(path), prompt) for path, prompt in jobs])
    done = subprocess.run(
        [sys.executable, "-c", LLAMA_SCRIPT, argument], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"llama.cpp failed on {jobs}: {done.stderr[-2000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return [(r["tokens"], np.asarray(r["logits"])) for r in results]
