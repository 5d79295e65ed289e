#!/usr/bin/env bash
# The whole GPU tier in one call on the device machine (repo root, torch/triton preinstalled there).
# Archives under build/gpu are built on the CPU-only machine first (scripts/build_gpu_fixtures.py)
# and carried along with the zstandard wheel (.whl). Logs go to $OUT; a short table prints last.
set -uo pipefail
OUT="${OUT:-/tmp/aotfuse_gpu}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=()
run() { local name=$1; shift; "$@" >"$OUT/$name.log" 2>&1; local rc=$?; status+=("$name:$rc"); tail -3 "$OUT/$name.log"; }
run check    python3 scripts/gpu_check.py build/gpu
run pytest   python3 -m pytest -q -m gpu tests
run driver   python3 scripts/gpu_smoke_driver.py
[ -d build/gpu_train ] && run train python3 scripts/gpu_train.py build/gpu_train
: > "$OUT/benchmarks.md"
for spec in ${BENCH_SPECS:-aotfuse.examples.gpt:demo aotfuse.examples.gpt:demo_bf16 aotfuse.examples.llama:block_bf16}; do
  run "bench_${spec##*:}" python3 -m aotfuse bench "$spec" --batch 1,8 --iters ${BENCH_ITERS:-200} --markdown "$OUT/benchmarks.md"
done
echo; echo "== GPU tier summary =="
grep -h "PASS\|FAIL" "$OUT/check.log" | tail -20
for s in "${status[@]}"; do echo "  $s"; done
grep -h "^|" "$OUT/benchmarks.md" | head -60
[ -f "$OUT/train.log" ] && sed -n '/== training/,$p' "$OUT/train.log"
