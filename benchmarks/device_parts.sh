# Sourced by the device-tool scripts (issue35_gpu.sh, issue33_gpu.sh): run in the copied tree with
# the image's own python3, jax and flax; logs land in $OUT (default: the caller's DEVICE_OUT).
# Defines part NAME SECONDS COMMAND... (one step under its own time limit, its log's last
# PART_TAIL lines echoed) and writes the device and versions to $OUT/env.log.
set -u
OUT=${OUT:-$DEVICE_OUT}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
part() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - start)) s"
  tail -n "${PART_TAIL:-30}" "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"
