#!/usr/bin/env bash
# Issue 33, thirty-ninth pass, in one call of the device tool (the tree copied there, run with the
# image's own python3, jax and flax): the region form's compiled train step against the transform
# and hand-written bf16 Flax on the 539M GPT and ResNet-50, as the tenth pass measured it, after
# the passes since (the softmax shift's max now computed again in float32). Logs land in $OUT.
#   bash benchmarks/issue33_gpu.sh
DEVICE_OUT=/tmp/issue33 PART_TAIL=24
. benchmarks/device_parts.sh
V="bf16 autocast"; R="bf16 autocast region"; H="bf16 hand-written Flax"
part gpt 270 python3 benchmarks/float8.py step --rounds 5 --steps 5 --only "$V" "$R" "$H"
part resnet 200 python3 benchmarks/float8.py resnet --rounds 5 --steps 5 --only "$H" "$V" "$R"
