#!/usr/bin/env bash
# Issue 33, forty-first pass, in one call of the device tool (the tree copied there, run with the
# image's own python3, jax and flax): region_overhead.py's trace part on that machine's otherwise
# idle processor (the issue's "quiet machine"), then its first call of a jitted train step
# compiled for the GPU (region against hand-written bf16 Flax at 2/4/12 blocks). Logs in $OUT.
#   bash benchmarks/issue33_first_call_gpu.sh
DEVICE_OUT=/tmp/issue33 PART_TAIL=16
. benchmarks/device_parts.sh
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/env.log"
# Tracing is Python on the host; the CPU backend keeps the GPU out of it, as on the CPU machines.
part trace_quiet 220 env JAX_PLATFORMS=cpu python3 benchmarks/region_overhead.py --parts trace \
  --reps 15
part first_call_gpu 250 python3 benchmarks/region_overhead.py --parts compile \
  --compile-blocks 2 4 12 --compile-reps 3
