#!/usr/bin/env bash
# Issue 35's GPU checks of 2026-11-28 in one call of the device tool (the tree copied there, run
# with the image's own python3, jax and flax): the live float8 check tests, the optimized HLO of
# their programs (the CPU tests' fixtures), the AdamW recipes' train step on the 539M GPT, and the
# 539M GPT without remat (MFU). Each part runs under its own time limit; logs land in $OUT.
#   bash benchmarks/issue35_gpu.sh
DEVICE_OUT=/tmp/issue35
. benchmarks/device_parts.sh
part gpu_tests 110 env JAMP_TESTS_XLA_FLAGS=given python3 -m pytest -q -p no:cacheprovider \
  tests/test_float8_gpu.py
part capture 80 python3 -m tests.float8_gpu_programs "$OUT/hlo"
tar czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo"
part mfu 160 python3 benchmarks/float8.py step --remat none --only "bf16 autocast" \
  "bf16 autocast region" "bf16 hand-written Flax" "float8 autocast"
part optim 190 python3 benchmarks/optim_state.py --skip memory,accuracy --step-config gpt-539m \
  --rounds 9
