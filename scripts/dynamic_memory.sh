#!/usr/bin/env bash
# Serving memory with dynamic dims (the twenty-eighth session's hosts): the zoo's Llama at its realistic size built
# twice with dynamic batch and sequence (hosts on, the default; and AOTFUSE_OUTPUT_HOSTS=0), both builds on this
# machine in parallel, then scripts/bench_dynamic.py on each: latency and peak memory per shape against eager and
# torch.compile (dynamic=True). Logs under $OUT; the tables print last.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
MODEL=${MODEL:-llama}; SHAPES=${SHAPES:-2x128,4x512,8x1024,2x2048}
DYN="--dynamic input_ids.0=1..8 --dynamic input_ids.1=2..2048"
t0=$SECONDS
python3 scripts/build_zoo_dynamic.py $MODEL /tmp/dyn_hosts.aotf $DYN > $OUT/build_hosts.log 2>&1 &
python3 scripts/build_zoo_dynamic.py $MODEL /tmp/dyn_plain.aotf $DYN --knob output_hosts=0 > $OUT/build_plain.log 2>&1 &
wait; echo "built $((SECONDS-t0))s"; tail -1 $OUT/build_hosts.log; tail -1 $OUT/build_plain.log
timeout 330 python3 scripts/bench_dynamic.py /tmp/dyn_hosts.aotf --spec zoo:$MODEL --shapes $SHAPES \
  --modes ${MODES:-eager,compile,reduce-overhead,aotfuse} --iters 20 --json $OUT/hosts.json > $OUT/bench_hosts.log 2>&1
echo "hosts rc=$? $((SECONDS-t0))s"
timeout 120 python3 scripts/bench_dynamic.py /tmp/dyn_plain.aotf --spec zoo:$MODEL --shapes $SHAPES \
  --modes aotfuse --iters 20 --json $OUT/plain.json > $OUT/bench_plain.log 2>&1
echo "plain rc=$? $((SECONDS-t0))s"
grep -A8 "^| shape" $OUT/bench_hosts.log; grep -A8 "^| shape" $OUT/bench_plain.log
