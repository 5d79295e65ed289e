"""`aotfuse bench --train`'s report (the timing itself runs on the GPU: scripts/gpu_tier.sh)."""
from __future__ import annotations

import pytest
import torch

from aotfuse.bench_train import TrainBenchResult, TrainRow, bench_train_spec, train_table
from aotfuse.errors import AotfuseError


def test_table_ratios_and_failed_contender():
    res = TrainBenchResult("aotfuse.examples.gpt:anchor_train", 8, True, (
        TrainRow("eager", 6.2, 6.0, 6.5, 1710.0),
        TrainRow("torch.compile", 3.1, 3.0, 3.3, 936.0, 1e-3, 40.0, 12.0),
        TrainRow("aotfuse", None, note="failed: BuildError: x")), 2**30)
    lines = train_table([res]).splitlines()
    assert "fwd+bwd+AdamW" in lines[2] and "1.00x" in lines[2] and "0.50x" in lines[2]
    assert "2.00x" in lines[3] and "936" in lines[3] and "1.0e-03" in lines[3] and "12.0" in lines[3]
    assert lines[4].rstrip().endswith("failed: BuildError: x")
    md = train_table([res], markdown=True).splitlines()
    assert md[0].startswith("| batch |") and len(md) == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda():
    with pytest.raises(AotfuseError, match="needs a CUDA device"):
        bench_train_spec("aotfuse.examples.gpt:demo_train")
