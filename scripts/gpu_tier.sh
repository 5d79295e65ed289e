#!/usr/bin/env bash
# The whole GPU tier in one call on the device machine (repo root, torch/triton preinstalled there).
# Archives under build/gpu are built on the machine itself if missing (building needs no GPU).
# STAGES picks what runs (default: all but the opt-in ones): repro host pytest sanitize check driver train bench
# kernels trainbench; opt-in: profile (scripts/profile_train.py: per-kernel GPU time of the anchor step, aotfuse vs
# torch.compile), knobs (scripts/knob_ab.py of KNOB_VARIANTS on KNOB_CASES: opt-in knobs vs the defaults), dynamic
# (one dynamic archive at many shapes, reduction-length variants), mm (matmul templates vs cuBLAS: tune_mm.py,
# graph_diag.py, knob_ab.py's training A/B), attn (the attention template vs sdpa) and zoo (scripts/zoo_gpu.py: each zoo model at its realistic size; copy $OUT/zoo_gpu.json to
# docs/zoo_gpu.json and run scripts/gen_models_doc.py).
# kernels: scripts/bench_kernels.py (memory-bound cases, % of copy); trainbench: `aotfuse bench --train` of
# TRAIN_SPECS (default: the anchor GPT, batch 8 x 1024, bf16).
# host: host time per call, this tree vs an older one unpacked in build/old (git archive REV aotfuse).
# Logs go to $OUT; a short table prints last.
set -uo pipefail
OUT="${OUT:-/tmp/aotfuse_gpu}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
STAGES=" ${STAGES:-repro host pytest sanitize check driver train bench kernels trainbench} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=()
run() { local name=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$name.log" 2>&1; local rc=$?
        status+=("$name:rc=$rc:$((SECONDS - t0))s"); tail -3 "$OUT/$name.log"; }
if want repro; then
  run ws_shared python3 scripts/repro/workspace_ownership.py shared
  run ws_owned  python3 scripts/repro/workspace_ownership.py owned
  run replay_crash python3 -X faulthandler scripts/repro/replay_crash.py
fi
if want host; then
  [ -d build/old ] && run host_before env PYTHONPATH=/tmp/site:$PWD/build/old python3 scripts/host_overhead.py
  run host_after python3 scripts/host_overhead.py
fi
want pytest && run pytest timeout -s ABRT ${PYTEST_TIMEOUT:-420} python3 -X faulthandler -m pytest -q -ra -m gpu tests
if want sanitize; then
  run san_build python3 scripts/sanitize_gpu.py build build/san
  run memcheck  compute-sanitizer --tool memcheck  --kernel-name kns=aotf_ --error-exitcode 9 python3 scripts/sanitize_gpu.py run build/san
  run racecheck compute-sanitizer --tool racecheck --kernel-name kns=aotf_ --error-exitcode 9 python3 scripts/sanitize_gpu.py kernels build/san
fi
if want check || want train; then
  [ -d build/gpu ] || python3 scripts/build_gpu_fixtures.py build/gpu >"$OUT/fixtures.log" 2>&1
  [ -d build/gpu_train ] || python3 scripts/build_gpu_fixtures.py build/gpu_train --train >>"$OUT/fixtures.log" 2>&1
fi
want check  && run check  python3 scripts/gpu_check.py build/gpu
want driver && run driver python3 scripts/gpu_smoke_driver.py
want train  && run train  python3 scripts/gpu_train.py build/gpu_train
if want bench; then
  : > "$OUT/benchmarks.md"
  for spec in ${BENCH_SPECS:-aotfuse.examples.gpt:demo aotfuse.examples.gpt:demo_bf16 aotfuse.examples.llama:block_bf16}; do
    run "bench_${spec##*:}" python3 -m aotfuse bench "$spec" --batch 1,8 --iters ${BENCH_ITERS:-200} --markdown "$OUT/benchmarks.md"
  done
fi
want kernels && run kernels python3 scripts/bench_kernels.py --iters ${KERNEL_ITERS:-50} --markdown "$OUT/kernels.md"
if want trainbench; then
  for spec in ${TRAIN_SPECS:-aotfuse.examples.gpt:anchor_train}; do
    run "trainbench_${spec##*:}" python3 -m aotfuse bench "$spec" --train --batch ${TRAIN_BATCH:-8} \
      --iters ${TRAIN_ITERS:-30} --markdown "$OUT/trainbench.md"
  done
fi
# opt-in stages (not in the default list: minutes each)
want profile && run profile python3 scripts/profile_train.py
# knobs: the opt-in knobs against the defaults (scripts/knob_ab.py: GPU kernel time next to torch.compile)
want knobs && run knobs python3 scripts/knob_ab.py --cases ${KNOB_CASES:-anchor,ce} \
  ${KNOB_VARIANTS:-base: pred:predicated_selects=1}
# dynamic: one dynamic archive of the anchor GPT at 9 shapes (scripts/bench_dynamic.py) and the reduction-length
# variants (scripts/variants_ab.py), issue 10
if want dynamic; then
  python3 -m aotfuse build aotfuse.examples.gpt:anchor --dynamic tokens.0=1..16 --dynamic tokens.1=1..1024 \
    -o build/anchor_dyn.aotf --arch "${DYN_ARCH:-sm_90}" >"$OUT/dyn_build.log" 2>&1
  run dynamic python3 scripts/bench_dynamic.py build/anchor_dyn.aotf --iters ${DYN_ITERS:-30} --json "$OUT/bench_dynamic.json"
  run variants python3 scripts/variants_ab.py --iters ${DYN_ITERS:-30}
fi
# mm: matmul templates (issue 11.3): tile configurations vs cuBLAS per anchor matmul, the anchor GPT per call
# with AOTFUSE_MM=extern vs auto (one process, interleaved), and the training step extern vs auto
if want mm; then
  run tune_mm python3 scripts/tune_mm.py --rows ${MM_ROWS:-8192,1024,128} --json "$OUT/tune_mm.json"
  for bs in ${MM_SHAPES:-8x1024 1x1024 1x128}; do
    run "graph_diag_$bs" python3 scripts/graph_diag.py --batch "${bs%x*}" --seq "${bs#*x}" --modes extern,auto,extern,auto
  done
  run mm_train python3 scripts/knob_ab.py --cases anchor base: auto:mm=auto
fi
# attn: the attention template vs torch's sdpa (scripts/attn_probe.py: the kernel alone; attn_mask_bench.py: kept
# masks through the runtime; attn_runtime_probe.py --launch-diag: the runtime's launch vs Triton's, occupancy)
if want attn; then
  run attn_probe python3 scripts/attn_probe.py --shapes ${ATTN_SHAPES:-8x1024,1x1024,1x128}
  run attn_mask python3 scripts/attn_mask_bench.py
  run attn_launch python3 scripts/attn_runtime_probe.py --launch-diag
fi
want zoo && run zoo python3 scripts/zoo_gpu.py ${ZOO_NAMES:-} --json "$OUT/zoo_gpu.json" --markdown "$OUT/zoo.md"
echo; echo "== GPU tier summary ($(date -u +%F)) =="
for s in "${status[@]}"; do echo "  $s"; done
[ -f "$OUT/replay_crash.log" ] && echo "replay_crash: $(tail -1 "$OUT/replay_crash.log")"
[ -f "$OUT/ws_shared.log" ] && echo "workspace shared: $(tail -2 "$OUT/ws_shared.log" | tr '\n' ' ')"
[ -f "$OUT/ws_owned.log" ] && echo "workspace owned: $(tail -2 "$OUT/ws_owned.log" | tr '\n' ' ')"
[ -f "$OUT/pytest.log" ] && tail -2 "$OUT/pytest.log"
for h in host_before host_after; do [ -f "$OUT/$h.log" ] && echo "$h: $(tail -1 "$OUT/$h.log")"; done
for t in memcheck racecheck; do [ -f "$OUT/$t.log" ] && { echo "$t:"; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|launched\|FAIL" "$OUT/$t.log" | tail -3; }; done
[ -f "$OUT/check.log" ] && grep -h "PASS\|FAIL" "$OUT/check.log" | tail -20
[ -f "$OUT/benchmarks.md" ] && grep -h "^|" "$OUT/benchmarks.md" | head -60
[ -f "$OUT/train.log" ] && sed -n '/== training/,$p' "$OUT/train.log"
[ -f "$OUT/kernels.md" ] && grep -h "^|" "$OUT/kernels.md"
[ -f "$OUT/trainbench.md" ] && grep -h "^|" "$OUT/trainbench.md"
[ -f "$OUT/knobs.log" ] && grep -h "^|" "$OUT/knobs.log"
[ -f "$OUT/dynamic.log" ] && grep -h "^|" "$OUT/dynamic.log"
[ -f "$OUT/variants.log" ] && grep -h "^|" "$OUT/variants.log"
[ -f "$OUT/tune_mm.log" ] && sed -n '/kernel time per call/,$p' "$OUT/tune_mm.log"
for f in "$OUT"/graph_diag_*.log; do [ -f "$f" ] && grep -h "graphs=True" "$f" | cut -c1-90; done
[ -f "$OUT/mm_train.log" ] && grep -h "^|" "$OUT/mm_train.log"
for f in attn_probe attn_mask; do [ -f "$OUT/$f.log" ] && grep -h "^|" "$OUT/$f.log"; done
[ -f "$OUT/attn_launch.log" ] && grep -h " us \|occupancy" "$OUT/attn_launch.log"
exit 0
