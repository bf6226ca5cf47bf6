#!/usr/bin/env bash
# One-GPU check, run as is from anywhere on a machine with one CUDA device (about 5-10 minutes):
#   1. the GPU tests: python -m pytest -q -k "cuda or gpu" (Triton kernels vs the reference dequantizer,
#      the store's GPU tier, ...);
#   2. benchmarks/bench_kernels_gpu.py: mat-vec GB/s of the Triton kernels on Kimi-K3 expert shapes vs
#      the device's copy bandwidth;
#   3. k3stream bench on a tiny audited-recipe model with the expert store's GPU tier (--gpu-mib).
# Installs nothing unless something is missing, and then only: pip install -e '.[test,gpu]'. A failing
# step does not stop the later ones; the summary at the end names them and the exit status is 1.
# Environment: PYTHON (default python3), WORK_DIR (tiny model; default a temporary directory, removed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

failed=()
say() { printf '\n==== %s\n' "$*"; }
run() {
    printf '+ %s\n' "$*"
    "$@"
}
# a step that may fail without stopping the check: `step NAME COMMAND...`
step() {
    local name=$1
    shift
    if ! run "$@"; then
        failed+=("$name")
        printf '!! %s failed\n' "$name"
    fi
}
# the CLI through this Python, whether or not its `k3stream` script is on PATH
k3stream() { "$PYTHON" -c 'import sys; from k3stream.cli import main; sys.exit(main())' "$@"; }

say "environment"
if ! "$PYTHON" -c "import k3stream, pytest, triton" 2>/dev/null; then
    say "installing the project with its test and gpu extras"
    run "$PYTHON" -m pip install -q -e '.[test,gpu]'
fi
"$PYTHON" - <<'EOF'
import sys

import torch
import triton

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device; this check needs one")
props = torch.cuda.get_device_properties(0)
print(f"device 0: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}")
EOF

say "1/3 GPU tests"
step "GPU tests" "$PYTHON" -m pytest -q -p no:cacheprovider -k "cuda or gpu"

say "2/3 Triton mat-vec bandwidth"
step "kernel bandwidth" "$PYTHON" benchmarks/bench_kernels_gpu.py

say "3/3 k3stream bench, tiny audited model, GPU expert tier"
if [ -n "${WORK_DIR:-}" ]; then
    work=$WORK_DIR
    mkdir -p "$work"
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
run k3stream make-tiny "$work/model" --recipe audited --hidden 512 --layers 8 --experts 64 --top-k 8 \
    --expert-ff 512 --latent 512 --kv-lora 256 --qk-nope 32
run k3stream pack "$work/model" --no-progress --force
manifest=$(ls "$work"/model/*.manifest.json)
# the pack is ~123 MiB: 64 MiB of GPU budget holds about half its experts, 256 MiB all of them
step "k3stream bench --gpu-mib 64" k3stream bench "$manifest" --device cuda --ram-mib 256 --gpu-mib 64
step "k3stream bench --gpu-mib 256" k3stream bench "$manifest" --device cuda --ram-mib 256 --gpu-mib 256

if [ ${#failed[@]} -gt 0 ]; then
    say "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
say "gpu_check: every step passed"
