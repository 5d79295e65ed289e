"""A training build's refusal names the model's line (joint/origins.py): aot_autograd's stack traces end in its own
generated code, so the line comes from the call sites recorded while the joint graph is traced."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.errors import UnsupportedOpError
from aotfuse.joint.origins import attribute, call_sites

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Pool3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(2, 2, 1)

    def forward(self, x):
        y = self.c(x)
        return F.max_pool3d(y, 3, 2, 1).square().mean()  # the refused op's line


def test_training_refusal_names_the_model_line():
    line = next(i for i, s in enumerate(inspect.getsource(Pool3d).splitlines())
                if "the refused op's line" in s) + inspect.getsourcelines(Pool3d)[1]
    with pytest.raises(UnsupportedOpError) as err:
        aotfuse.build(Pool3d().train(), (torch.randn(1, 2, 5, 6, 6),), train=True, targets=("sm_90",))
    msg = str(err.value)
    assert "max_pool3d_with_indices_backward" in msg
    assert f'test_origins.py", line {line}, in forward' in msg and "call of max_pool3d" in msg, msg


def test_call_sites_and_attribution():
    """The recorder keeps the model's lines per torch function; attribution picks the longest recorded name an op's
    name starts with, and leaves nodes that have a model frame of their own alone."""
    x = torch.randn(3, 4)
    with call_sites() as rec:
        torch.sort(x, -1)
        torch.sort(x, 0)
        F.softmax(x, -1)
    assert [len(v) for k, v in rec.sites.items() if k == "sort"] == [2]
    assert all(__file__ in s for s in rec.sites["sort"])

    g = torch.fx.Graph()
    a = g.placeholder("a")
    s = g.call_function(torch.ops.aten.sort.default, (a,))
    sm = g.call_function(torch.ops.aten._softmax_backward_data.default, (a, a, -1, torch.float32))
    own = g.call_function(torch.ops.aten.sort.stable, (a,))
    own.meta["stack_trace"] = 'File "/home/me/model.py", line 3, in forward\n    torch.sort(x)'
    g.output((s, sm, own))
    gm = torch.fx.GraphModule({}, g)
    attribute(gm, rec.sites)
    assert s.meta["aotfuse_call_site"][0] == "sort" and sm.meta["aotfuse_call_site"][0] == "softmax"
    assert "aotfuse_call_site" not in own.meta


def test_attribution_needs_a_whole_name():
    """A recorded call is an op's origin only up to a name boundary: exp's line is not exponential's (PhiMoE's
    router draws were blamed on the loss's exp)."""
    x = torch.randn(3, 4)
    with call_sites() as rec:
        torch.exp(x)
    g = torch.fx.Graph()
    a = g.placeholder("a")
    draw = g.call_function(torch.ops.aten.exponential.default, (a,))
    back = g.call_function(torch.ops.aten.exp.default, (a,))
    g.output((draw, back))
    gm = torch.fx.GraphModule({}, g)
    attribute(gm, rec.sites)
    assert "aotfuse_call_site" not in draw.meta and back.meta["aotfuse_call_site"][0] == "exp"
