#!/usr/bin/env bash
# Issue 35's GPU checks of 2026-11-28 in one call of the device tool (the tree copied there, run
# with the image's own python3, jax and flax): the live float8 check tests, the optimized HLO of
# their programs (the CPU tests' fixtures), the AdamW recipes' train step on the 539M GPT, and the
# 539M GPT without remat (MFU). Each part runs under its own time limit; logs land in $OUT.
#   bash benchmarks/issue35_gpu.sh
set -u
OUT=${OUT:-/tmp/issue35}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
part() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - start)) s"
  tail -n 30 "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"
part gpu_tests 110 env JAMP_TESTS_XLA_FLAGS=given python3 -m pytest -q -p no:cacheprovider \
  tests/test_float8_gpu.py
part capture 80 python3 -m tests.float8_gpu_programs "$OUT/hlo"
tar czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo"
part mfu 160 python3 benchmarks/float8.py step --remat none --only "bf16 autocast" \
  "bf16 autocast region" "bf16 hand-written Flax" "float8 autocast"
part optim 190 python3 benchmarks/optim_state.py --skip memory,accuracy --step-config gpt-539m \
  --rounds 9
