#!/usr/bin/env bash
# A session's GPU call: the GPU tier, the anchor's training step with PDL launches on and off, and zoo models'
# training against torch.compile (default: T5's heads-last attention bias, Phi-3's copied views, Gemma-2's tied
# table, MobileNetV2's BatchNorm backward: the twenty-fourth session's changes). Logs under $OUT; a short table last.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
t0=$SECONDS
if [[ " ${STAGES:-tier train zoo} " == *" tier "* ]]; then
  timeout -s ABRT 330 python3 -X faulthandler -m pytest -q -ra -m gpu tests > $OUT/pytest.log 2>&1; echo "tier rc=$? $((SECONDS-t0))s"
  tail -4 $OUT/pytest.log
fi
if [[ " ${STAGES:-tier train zoo} " == *" train "* ]]; then
  for mode in kernels off; do
    AOTFUSE_PDL_LAUNCH=$mode timeout 150 python3 -m aotfuse bench aotfuse.examples.gpt:anchor_train --train --batch 8 --iters 30 > $OUT/train_$mode.log 2>&1
    echo "train pdl_launch=$mode rc=$? $((SECONDS-t0))s"; tail -4 $OUT/train_$mode.log
  done
fi
if [[ " ${STAGES:-tier train zoo} " == *" zoo "* ]]; then
  timeout ${ZOO_TIMEOUT:-300} python3 scripts/zoo_gpu.py --more ${ZOO_ARGS:---mode train t5 phi3 gemma2 mobilenet_v2} --iters 20 --json $OUT/zoo.json > $OUT/zoo.log 2>&1
  echo "zoo rc=$? $((SECONDS-t0))s"; tail -12 $OUT/zoo.log
fi
