#!/usr/bin/env bash
# Issue 35, second device call of 2026-11-28: the live float8-check tests after the check learnt
# Triton float8 GEMMs, and whether a Triton GEMM on float8 operands multiplies in float8: its
# speed against the same dot in bf16 (benchmarks/float8.py gemm) and the float8 matrix
# instructions in the PTX XLA compiled (dumped for the gemm_probe modules only).
#   bash benchmarks/issue35_gpu_triton.sh
set -u
OUT=${OUT:-/tmp/issue35}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
JAMP_TESTS_XLA_FLAGS=given timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_float8_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
dump=/tmp/xla_dump
XLA_FLAGS="--xla_dump_to=$dump --xla_dump_hlo_module_re=gemm_probe" timeout 150 python3 \
  benchmarks/float8.py gemm --rounds 5 --steps 20 2>&1 | tee "$OUT/gemm.log" | tail -n 16
ls "$dump" | grep -c . ; ls "$dump" | grep ptx | head -n 20
for f in "$dump"/*.ptx; do
  echo "$(basename "$f"): $(grep -cE 'mma[^ ]*\.e4m3|mma[^ ]*\.e5m2' "$f") float8 mma lines;" \
    "$(grep -oE '(wgmma|mma)[.a-z0-9_]*' "$f" | sort | uniq -c | sort -rn | head -n 4 | tr '\n' ' ')"
done 2>&1 | tee "$OUT/ptx.log"
