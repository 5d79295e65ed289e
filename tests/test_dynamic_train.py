"""Dynamic dims in training archives (issue 10): one `--train` archive serves a range of batch sizes and
sequence lengths; loss and every gradient match eager autograd at each shape (CPU path: the interpreter).

The joint graph is traced with symbolic sizes (joint/dims.py); sizes are neither saved nor recomputed
between the forward and the backward (partition/mincut.dim_value); every program of a step runs at
the dims the forward's guards bound (runtime/training.py: per-shape executors and graphs).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotfuse
from aotfuse.errors import BuildError, GuardError
from test_train_cpu import rel, small_gpt  # the training tier's model (tests/ is on sys.path)

DIMS = ["tokens.0=1..4", "tokens.1=1..8", "targets.0=1..4", "targets.1=1..8"]
SHAPES = [(2, 8), (1, 1), (3, 5), (4, 8)]  # the example, the range's low end, odd sizes, the high end


def _check_shapes(model, mod, shapes, make):
    ref_model = copy.deepcopy(model)
    ref_params = dict(ref_model.named_parameters())
    for k, shape in enumerate(shapes):
        inputs = make(shape, seed=10 + k)
        loss = mod(*inputs)
        loss.backward()
        ref = ref_model(*inputs)
        ref.backward()
        assert rel(loss, ref) < 1e-5, (shape, float(loss), float(ref))
        for name, p in mod.named_parameters():
            assert rel(p.grad, ref_params[name].grad) < 1e-4, (shape, name)
            p.grad = None
            ref_params[name].grad = None


def _tokens(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g)


@pytest.mark.parametrize("how", [dict(step="split"), dict(step="auto"), dict(step="split", backward_stages=3)],
                         ids=["split", "fused_step", "staged"])
def test_gpt_one_train_archive_many_shapes(how):
    model, inputs = small_gpt()
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), dynamic_shapes=DIMS, **how)
    m = res.manifest
    # tokens and targets must be equal: the trace found it (one symbol per pair of axes)
    assert [(d.name, d.lo, d.hi, d.hint) for d in m.dims] == [("tokens.0", 1, 4, 2), ("tokens.1", 1, 8, 8)]
    assert m.inputs[0].shape == m.inputs[1].shape == ("s0", "s1")
    if how.get("backward_stages"):
        assert len(m.programs) > 2
    art = aotfuse.load(res.data, device="cpu")
    mod = art.as_module()
    _check_shapes(model, mod, SHAPES, _tokens)
    assert mod.shape_stats()["cached"] == len(set(SHAPES))
    # the artifact's own call runs the forward at the shape (the loss)
    x = _tokens((3, 5), 99)
    assert rel(art(*x), model(*x)) < 1e-5


def test_sizes_cross_no_cut():
    """A size of a dynamic dim (`b * t` of a view) is not a saved value: the backward program reads it from
    its dims, and the forward returns only tensors."""
    model, inputs = small_gpt()
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), dynamic_shapes=DIMS, step="split")
    saved = res.report.partition["saved"]
    assert saved and all(s["dtype"] for s in saved), saved
    art = aotfuse.load(res.data, device="cpu")
    fwd, bwd = art.programs["forward"], art.programs["backward"]
    assert len(bwd.inputs) == res.manifest.train.n_saved + 1  # saved tensors + the loss gradient
    assert any(not isinstance(s, int) for i in bwd.inputs for s in i.shape)  # saved tensors of dynamic shapes
    assert "s0" in str(fwd.arena_bytes) and "s0" in str(bwd.arena_bytes)


def test_guards_and_relations_are_checked_before_anything_runs():
    model, inputs = small_gpt()
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), dynamic_shapes=DIMS)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    t = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(GuardError, match=r"tokens.*dim 1 = 9 is outside"):
        mod(t, t)
    with pytest.raises(GuardError, match="targets"):  # its axes are the tokens' dims
        mod(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))


def test_shapes_beyond_the_cache_are_released_and_a_pending_backward_still_runs(monkeypatch):
    """At most knobs.shape_cache shapes per module; a forward whose shape was evicted before its backward
    keeps its programs (the context holds them) and its backward runs at the forward's shape."""
    from aotfuse.knobs import knobs

    monkeypatch.setattr(knobs, "shape_cache", 2)
    model, inputs = small_gpt()
    res = aotfuse.build(model, inputs, train=True, targets=("sm_90",), dynamic_shapes=DIMS)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref_model = copy.deepcopy(model)
    first = _tokens((3, 5), 1)
    pending = mod(*first)  # its backward comes after two other shapes pushed it out
    for shape in ((1, 1), (4, 8)):
        mod(*_tokens(shape, 2)).backward()
    assert mod.shape_stats()["cached"] == 2
    assert [s["dims"] for s in mod.shape_stats()["shapes"]] == [{"s0": 1, "s1": 1}, {"s0": 4, "s1": 8}]
    for p in mod.parameters():
        p.grad = None
    pending.backward()
    ref_model(*first).backward()
    ref = dict(ref_model.named_parameters())
    for name, p in mod.named_parameters():
        assert rel(p.grad, ref[name].grad) < 1e-4, name


class _TrainBN(nn.Module):
    """Train-mode BatchNorm (batch statistics, running-stat updates with n / (n - 1)) over a dynamic batch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before BN has a zero gradient
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return F.cross_entropy(self.fc(h), y)


def test_train_mode_batchnorm_over_a_dynamic_batch():
    """The running variance's unbiased correction n / (n - 1) is a ratio of dynamic sizes: computed in the
    kernel from its dim arguments (a SymFloat of the joint graph); gradients and running statistics vs eager."""
    torch.manual_seed(0)
    model = _TrainBN().train()
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    res = aotfuse.build(model, (x, y), train=True, targets=("sm_90",), dynamic_shapes=["x.0=1..8", "y.0=1..8"])
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    refp = dict(ref.named_parameters())
    for b in (4, 1, 7):
        xb, yb = torch.randn(b, 3, 6, 6), torch.randint(0, 5, (b,))
        mod(xb, yb).backward()
        ref(xb, yb).backward()
        for name, p in mod.named_parameters():
            assert rel(p.grad, refp[name].grad) < 1e-4, (b, name)
            p.grad = None
            refp[name].grad = None
        bufs = dict(mod.named_buffers())
        for name, t in ref.named_buffers():
            assert torch.allclose(bufs[name].float(), t.float(), rtol=1e-5, atol=1e-6), (b, name)


class _FixesBatch(nn.Module):
    """Reshapes by the example's batch size: a dynamic batch would be fixed to 2."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).reshape(2, -1).sum()


def test_a_trace_that_fixes_a_dim_is_refused_naming_it():
    with pytest.raises(BuildError, match=r"fixed a dynamic size .*Eq\(x\.0, 2\)") as e:
        aotfuse.build(_FixesBatch(), (torch.randn(2, 4),), train=True, targets=("sm_90",),
                      dynamic_shapes=["x.0=1..8"])
    assert "drop --dynamic" in e.value.remedy


class _Dropout(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.dropout(x * self.w, 0.25, training=True).sum()


def test_dropout_at_dynamic_sizes_same_mask_in_backward():
    """Random masks of a dynamic size: the backward sees the forward's mask (saved unpacked: bit-packing
    needs a static shape, the partition says so)."""
    d = 64
    res = aotfuse.build(_Dropout(d), (torch.ones(16, d),), train=True, targets=("sm_90",), step="split",
                        dynamic_shapes=["x.0=1..512"])
    masks = [s for s in res.report.partition["saved"] if s["dtype"] == "bool"]
    assert masks and not any(s.get("packed") for s in masks)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    torch.manual_seed(0)
    for n in (1, 37, 512):
        loss = mod(torch.ones(n, d))
        loss.backward()
        g = mod._param_list[0].grad
        # d loss / d w = column sums of mask / (1 - p): their sum is the loss only with the forward's mask
        assert torch.allclose(g.sum(), loss.detach(), rtol=1e-5), n
        mod._param_list[0].grad = None
    keep = float(loss.detach()) * 0.75 / (512 * d)
    assert abs(keep - 0.75) < 0.02, keep


def test_transformers_llama_train_dynamic_batch_and_sequence():
    """transformers' Llama (tiny), `labels=` loss: one train archive, batch 1..8 x sequence 2..32."""
    from aotfuse.testing.zoo import entry, have_transformers

    if not have_transformers():
        pytest.skip("needs transformers")
    ex = entry("llama").tiny(train=True)
    res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, train=True, targets=("sm_90",),
                        dynamic_shapes=["input_ids.0=1..8", "input_ids.1=2..32", "labels.0=1..8", "labels.1=2..32"])
    assert [d.name for d in res.manifest.dims] == ["input_ids.0", "input_ids.1"]
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref_model = copy.deepcopy(ex.model)
    ref_params = dict(ref_model.named_parameters())
    g = torch.Generator().manual_seed(2)
    for b, t in ((1, 2), (3, 7), (8, 32)):
        ids = torch.randint(0, 100, (b, t), generator=g)
        loss = mod(input_ids=ids, labels=ids).loss
        loss.backward()
        ref = ref_model(input_ids=ids, labels=ids).loss
        ref.backward()
        assert rel(loss, ref) < 1e-5, (b, t)
        for name, p in mod.named_parameters():
            assert rel(p.grad, ref_params[name].grad) < 1e-4, (b, t, name)
            p.grad = None
            ref_params[name].grad = None


def test_cli_builds_a_dynamic_train_archive(tmp_path):
    from typer.testing import CliRunner

    from aotfuse.cli import app

    out = tmp_path / "t.aotf"
    r = CliRunner().invoke(app, ["build", "aotfuse.examples.gpt:demo_train", "--train", "--arch", "sm_90",
                                 "--dynamic", "tokens.0=1..4", "--dynamic", "targets.0=1..4", "-o", str(out)])
    assert r.exit_code == 0, r.output
    info = aotfuse.load(out, device="cpu").inspect()
    assert [d["name"] for d in info["dims"]] == ["tokens.0"] and info["train"]["mode"] == "split"


class _Square(nn.Module):
    """tokens and targets of an 8 x 8 example: batch and sequence have the same size and range."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 16)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.lin(self.emb(tokens)).reshape(-1, 16), targets.reshape(-1))


def test_relations_merge_the_same_axes_not_every_dim_of_one_size():
    """A square example: tokens.0 ~ targets.0 and tokens.1 ~ targets.1, never batch ~ sequence (which would
    accept square inputs only)."""
    g = torch.Generator().manual_seed(0)
    ex = (torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
    model = _Square()
    res = aotfuse.build(model, ex, train=True, targets=("sm_90",),
                        dynamic_shapes=["tokens.0=1..8", "tokens.1=1..8", "targets.0=1..8", "targets.1=1..8"])
    assert [i.shape for i in res.manifest.inputs] == [("s0", "s1"), ("s0", "s1")]
    mod = aotfuse.load(res.data, device="cpu").as_module()
    t = torch.randint(0, 16, (3, 5), generator=g)
    assert rel(mod(t, t), model(t, t)) < 1e-5


class _ScaledByBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) * (0.7071067811865476 / x.shape[0])).pow(2).sum()


@pytest.mark.parametrize("step", ["split", "auto"])
def test_a_ratio_of_sizes_in_the_backward_and_a_float_over_a_dim(step):
    """`h * (c / batch)`: a SymFloat the backward reads (neither saved nor recomputed, as sizes), and a float
    coefficient over a dim kept a float literal in the kernel."""
    torch.manual_seed(0)
    model = _ScaledByBatch().train()
    res = aotfuse.build(model, (torch.randn(6, 8),), train=True, targets=("sm_90",), dynamic_shapes=["x.0=1..16"],
                        step=step, backward_stages=None)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    _check_shapes(model, mod, [(1,), (3,), (16,)], lambda shape, seed: (torch.randn(shape[0], 8,
                  generator=torch.Generator().manual_seed(seed)),))


class _InputGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def test_a_fused_step_with_a_gradient_of_a_dynamic_shape_falls_back_to_split():
    x = torch.randn(4, 8).requires_grad_()
    res = aotfuse.build(_InputGrad(), (x,), train=True, targets=("sm_90",), dynamic_shapes=["x.0=1..8"], step="auto")
    assert res.manifest.train.mode == "split"
    assert "dynamic shape" in res.report.partition["step"]["why"]
    with pytest.raises(BuildError, match="step='step' with dynamic dims"):
        aotfuse.build(_InputGrad(), (x,), train=True, targets=("sm_90",), dynamic_shapes=["x.0=1..8"], step="step")
