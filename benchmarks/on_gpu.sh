#!/usr/bin/env bash
# The benchmarks with a GPU reading, as run on a one-GPU machine with JAX's CUDA plugin
# installed (numbers in the README and docs/benchmarks.md): writes each report into OUT_DIR.
# A benchmark that fails or runs over its time is reported and the next one still runs;
# the exit status is 1 if any failed.
set -u
out=${1:?usage: benchmarks/on_gpu.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")" || exit 1
export PYTHONPATH=..${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, jax.devices())" || exit 1
status=0
run() {
  local seconds=$1; shift
  echo "== $* (at most ${seconds} s)"
  timeout "$seconds" python3 "$@" --out "$out" || { echo "== FAILED: $*"; status=1; }
}
run 100 precision.py --dims 1024 8192 8192 10 --batch 8192
run 100 sharding.py --gpu
run 120 train_step.py
run 150 manager_costs.py --repeats 30
exit $status
