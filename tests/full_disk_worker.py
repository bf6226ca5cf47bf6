"""Run by tests/test_prompt_cache.py in a mount namespace of its own (`unshare --user --map-root-user
--mount`): a tmpfs of SIZE bytes mounted at FOLDER holds a prompt cache's disk tier with a budget far
above it; an eight-turn conversation outgrows the file system; a restarted cache then restores the
ninth turn from the newest state it holds. Prints one JSON line: disk errors, tokens reused, the
eighth response's end, and whether the restored logits are the cold prefill's.

    unshare --user --map-root-user --mount python tests/full_disk_worker.py MODEL FOLDER SIZE
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import k3stream
from k3stream.engine.fingerprints import model_fingerprint
from k3stream.engine.prompt_cache import PromptCache
from k3stream.gguf.reader import K3Checkpoint
from k3stream.memlimit import MIB
from test_prompt_cache import cold, conversation


def main(model_path: str, folder: str, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], check=True)
    torch.set_num_threads(1)
    model = k3stream.load(model_path)
    fingerprint = model_fingerprint(K3Checkpoint.open(model_path).shards)
    cache = PromptCache(model, fingerprint, 64 * MIB, folder, 1 << 30, every=1 << 20)
    prompts = conversation(model, cache, 8)
    errors = cache.stats.disk_errors
    cache.close()
    # the ninth turn's prompt (the same conversation again, in RAM alone) extends the eighth's response
    prompt = conversation(model, PromptCache(model, fingerprint, 64 * MIB), 9)[-1]
    restarted = PromptCache(model, fingerprint, 64 * MIB, folder, 1 << 30)
    got = restarted.prefill(prompt)
    restarted.close()
    same = torch.equal(got.logits, cold(model, prompt))
    newest = len(prompts[-1]) + 3  # the eighth response's end: its prompt and 3 of its 4 answer tokens
    print(json.dumps({"errors": errors, "reused": got.reused, "newest": newest, "cold": same}))


if __name__ == "__main__":
    main(*sys.argv[1:])
