"""Back-compat: the golden model archive written by an earlier aotfuse still loads and runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import aotfuse

GOLDEN = Path(__file__).resolve().parents[1] / "artifacts" / "golden"


def _expected():
    data = json.loads((GOLDEN / "v1_model.json").read_text())
    return torch.tensor(data["input"]), [torch.tensor(o) for o in data["outputs"]]


def test_golden_model_archive_runs_on_cpu():
    ids, expected = _expected()
    info = aotfuse.inspect_archive(GOLDEN / "v1_model.aotf")
    assert info["format_version"] == 1 and info["targets"] == ["sm_80", "sm_90"]
    art = aotfuse.load(GOLDEN / "v1_model.aotf", device="cpu")
    outs = art(ids)
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_golden_model_archive_runs_on_gpu():
    ids, expected = _expected()
    art = aotfuse.load(GOLDEN / "v1_model.aotf", device="cuda")
    for o, e in zip(art(ids.cuda()), expected):
        torch.testing.assert_close(o.cpu(), e, rtol=1e-4, atol=1e-5)


def _expected_cnn():
    data = json.loads((GOLDEN / "v1_cnn.json").read_text())
    return torch.tensor(data["input"]), torch.tensor(data["outputs"][0])


def test_golden_cnn_archive_calls_the_legacy_convolution_out_and_runs_on_cpu():
    """Built before convolutions became the functional op: its program calls aten.convolution.out."""
    from aotfuse.archive import read_archive
    from aotfuse.runtime.payload import read_payload

    called = {i.target for p in read_payload(read_archive(GOLDEN / "v1_cnn.aotf")).programs.values()
              for i in p.instructions if hasattr(i, "target")}
    assert called == {"aten.convolution.out"}
    x, expected = _expected_cnn()
    torch.testing.assert_close(aotfuse.load(GOLDEN / "v1_cnn.aotf", device="cpu")(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_golden_cnn_archive_runs_on_gpu():
    x, expected = _expected_cnn()
    art = aotfuse.load(GOLDEN / "v1_cnn.aotf", device="cuda")
    torch.testing.assert_close(art(x.cuda()).cpu(), expected, rtol=1e-4, atol=1e-4)
