#!/usr/bin/env bash
# The benchmark report's core tables on an accelerator (a GPU or a TPU), in a few minutes:
# per-step time at num_steps 1 and 10 against jax.jit, the hand-written recipe,
# eqx.filter_jit and nnx.jit, packing (section 2), overhead against the number of leaves (3),
# compile time and memory (4).
#
#   bash benchmarks/gpu.sh [OUT_DIR]      # default: benchmarks/results/gpu
#
# Needs JAX for the accelerator (its GPU plugin, or libtpu), equinox, flax, optax and
# libcst; run from anywhere. On a TPU v5e it took about 5 min (sections 2 and 3-4 apart).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
PYTHONUNBUFFERED=1 python3 benchmarks/report.py --quick --sections 2,3,4 --jobs 4 --out "$out"
