"""Model zoo tier (aotfuse/testing/zoo.py, tiny configs) on the CPU path: the models people use, called
the way they call them (keyword arguments, `labels=` for the loss), built and checked against eager:
every output (inference), the loss and every gradient (training), fp32 and a bf16 subset.

Entries that still stop at an op another change adds are xfail(strict=True) with the exact error,
so they turn into failures the moment they start to pass (then move them to EXPECTED_PASS).
Most cases are slow (seconds to minutes in Triton's interpreter): `-m 'not slow'` keeps a quick set.
"""
from __future__ import annotations

import copy

import pytest
import torch

import aotfuse
from aotfuse.errors import BuildError, UnsupportedOpError
from aotfuse.testing.zoo import KNOWN_FAILURES, ZOO, flat_inputs, have_transformers, loss_of, output_leaves

# (entry, mode) -> (exception type, message fragment, reason) for cases that fail today (one table with
# docs/models.md: aotfuse/testing/zoo.py KNOWN_FAILURES).
_ERRORS = {"BuildError": BuildError, "UnsupportedOpError": UnsupportedOpError, "AssertionError": AssertionError}
EXPECTED_FAIL = {k: (_ERRORS[cls], frag, why) for k, (cls, frag, why) in KNOWN_FAILURES.items()}
# Quick enough for the default tier (build + one CPU run under ~15 s on 2 cores); the rest are slow.
FAST = {("llama", "infer"), ("gpt2", "infer")}

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _cases():
    out = []
    for e in ZOO:
        for mode in ("infer", "train"):
            for dtype in e.dtypes:
                if mode == "train" and dtype != torch.float32 and e.name != "gpt2":
                    continue  # bf16 training: one model (the rest fp32)
                marks = []
                if "transformers" in e.needs:
                    marks.append(pytest.mark.skipif(not have_transformers(), reason="needs transformers (test extra)"))
                fail = EXPECTED_FAIL.get((e.name, mode))
                if fail:
                    marks.append(pytest.mark.xfail(strict=True, raises=fail[0], reason=fail[2]))
                elif (e.name, mode) not in FAST or dtype != torch.float32:
                    marks.append(pytest.mark.slow)
                out.append(pytest.param(e, mode, dtype, marks=marks, id=f"{e.name}-{mode}-{str(dtype)[6:]}"))
    return out


def _rel(a, b, floor: float = 1e-30) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), floor))


def _build(entry, train: bool, dtype):
    ex = entry.tiny(train=train, dtype=dtype)
    fail = EXPECTED_FAIL.get((entry.name, "train" if train else "infer"))
    try:
        res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, train=train, targets=("sm_90",))
    except (BuildError, UnsupportedOpError) as exc:
        if fail:  # the expected failure, and no other: a different error is a real failure
            assert isinstance(exc, fail[0]) and fail[1] in str(exc), f"expected {fail[1]!r}, got {exc}"
        raise
    return ex, res


@pytest.mark.parametrize("entry,mode,dtype", _cases())
def test_zoo_matches_eager(entry, mode, dtype):
    train = mode == "train"
    ex, res = _build(entry, train, dtype)
    call = res.manifest.call
    art = aotfuse.load(res.data, device="cpu")
    inputs = ex.make_inputs(11)  # fresh random inputs, not the example
    flat = flat_inputs(inputs, call["inputs"])
    ref_model = copy.deepcopy(ex.model)
    if not train:
        with torch.no_grad():
            eager = ex.call(ref_model, inputs)
        # the recorded output structure is the model's own (ModelOutput fields / dict keys / tensor)
        if hasattr(eager, "keys"):
            assert call["outputs"]["kind"] == "dict" and call["outputs"]["keys"] == list(eager.keys())
            assert call["outputs"]["class"].endswith(type(eager).__qualname__)
        got = art(*inputs[0], **inputs[1])  # called as the model is: keywords in, its output structure out
        if hasattr(eager, "keys"):
            assert type(got).__name__ == type(eager).__name__ and list(got.keys()) == list(eager.keys())
        outs = output_leaves(got)
        assert len(flat) == len(art.input_specs)
        refs = output_leaves(eager)
        assert len(outs) == len(refs)
        for i, (o, r) in enumerate(zip(outs, refs)):
            assert o.shape == r.shape and o.dtype == r.dtype
            if dtype == torch.float32:
                err = _rel(o, r)
                assert err <= TOL[dtype], f"{entry.name} output {i}: rel err {err:.2e}"
            else:  # judge both against fp32 eager: bf16 eager rounds after every op
                ref32 = output_leaves(ex.call(copy.deepcopy(ex.model).float(), _float(inputs)))[i]
                err, eager_err = _rel(o, ref32), _rel(r, ref32)
                assert err <= max(TOL[dtype], 2 * eager_err), f"{entry.name} output {i}: {err:.2e} (eager {eager_err:.2e})"
        return
    mod = art.as_module()
    loss = loss_of(mod(*inputs[0], **inputs[1]))
    loss.backward()
    ref = loss_of(ex.call(ref_model, inputs))
    ref.backward()
    if _rel(loss, ref) >= TOL[dtype]:
        # The loss of a deep train-mode network (hf_resnet: BatchNorm statistics over few values per channel)
        # amplifies summation-order differences: judge both against float64, no further than twice eager's
        # own error (as the gradients below are).
        loss64 = _float64_loss(ex, inputs)
        ours_err, eager_err = _rel(loss, loss64), _rel(ref, loss64)
        assert ours_err <= max(TOL[dtype], 2 * eager_err), (float(loss), float(ref), float(loss64))
    ours = dict(mod.named_parameters())
    grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert set(ours) == {n for n, _ in ref_model.named_parameters()}
    # a gradient that is zero in exact arithmetic (attention's key bias) is judged against the others' scale
    floor = 1e-3 * max(float(g.double().norm()) for g in grads.values())
    exact = None
    for n, g in grads.items():
        assert ours[n].grad is not None, n
        err = _rel(ours[n].grad, g, floor)
        if err < GRAD_TOL[dtype]:
            continue
        # An ill-conditioned gradient (hf_resnet's last train-mode BatchNorm normalizes 2 values per channel:
        # its backward cancels almost exactly, and eager fp32 itself is ~5e-4 off): judge both against a
        # float64 run, as `aotfuse verify` judges half precision: no further than twice eager's own error.
        exact = exact or _float64_grads(ex, inputs)
        ours_err, eager_err = _rel(ours[n].grad, exact[n], floor), _rel(g, exact[n], floor)
        assert ours_err <= 2 * eager_err, (f"{entry.name}: grad of {n}: {err:.2e} from eager, {ours_err:.2e} from "
                                           f"float64 (eager {eager_err:.2e})")
    # buffers the forward updates (train-mode BatchNorm's running statistics) are written back as eager does
    ref_bufs, our_bufs = dict(ref_model.named_buffers()), dict(mod.named_buffers())
    assert set(our_bufs) == set(res.manifest.train.mutated_buffers)
    for n, b in our_bufs.items():
        if b.is_floating_point():
            assert _rel(b, ref_bufs[n]) < TOL[dtype], f"{entry.name}: buffer {n}"
        else:
            assert torch.equal(b, ref_bufs[n]), f"{entry.name}: buffer {n}"


def _float64_loss(ex, inputs) -> torch.Tensor:
    model = copy.deepcopy(ex.model).double()
    args, kw = inputs
    d = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    with torch.no_grad():
        return loss_of(ex.call(model, (tuple(d(a) for a in args), {k: d(v) for k, v in kw.items()})))


def _float64_grads(ex, inputs) -> dict:
    """Every parameter's gradient from a float64 copy of the model (the reference for ill-conditioned ones)."""
    model = copy.deepcopy(ex.model).double()
    args, kw = inputs
    d = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    loss_of(ex.call(model, (tuple(d(a) for a in args), {k: d(v) for k, v in kw.items()}))).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _float(inputs):
    args, kw = inputs
    f = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(f(a) for a in args), {k: f(v) for k, v in kw.items()}


# ---------------------------------------------------------------- capture features, quick

class _KwModel(torch.nn.Module):
    """forward(x, *, scale=None, labels=None, flag=True) -> {"loss"?, "y", "z"}; one tied weight."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied, as an LM head to its embedding

    def forward(self, x, scale=None, labels=None, flag=True):
        y = self.b(torch.relu(self.a(x)))
        if scale is not None:
            y = y * scale
        out = {"y": y, "z": y.sum(-1)}
        if labels is not None:
            out = {"loss": torch.nn.functional.cross_entropy(y, labels), **out}
        return out if flag else tuple(out.values())


def test_keyword_inputs_are_named_and_ordered_by_signature():
    torch.manual_seed(0)
    m = _KwModel().eval()
    x, s = torch.randn(3, 4), torch.randn(3, 4)
    res = aotfuse.build(m, (x,), example_kwargs={"flag": True, "scale": s}, targets=("sm_90",))
    call = res.manifest.call
    # the constant is baked in and recorded: a call may pass it again with its value (runtime/calling.py)
    assert call["inputs"] == {"positional": 1, "keywords": ["scale"], "constants": {"flag": True}}
    assert call["outputs"] == {"kind": "dict", "class": "builtins.dict", "keys": ["y", "z"],
                               "items": [{"kind": "tensor"}, {"kind": "tensor"}]}
    art = aotfuse.load(res.data, device="cpu")
    assert [s_.name for s_ in art.input_specs] == ["x", "scale"]
    x2, s2 = torch.randn(3, 4), torch.randn(3, 4)
    out = art(x2, scale=s2)
    assert type(out) is dict and list(out) == ["y", "z"]
    torch.testing.assert_close(art(x2, scale=s2, flag=True)["y"], out["y"], rtol=0, atol=0)
    y, z = out["y"], out["z"]
    ref = m(x2, scale=s2)
    assert torch.allclose(y, ref["y"], atol=1e-5) and torch.allclose(z, ref["z"], atol=1e-5)


def test_train_with_labels_keyword_and_tied_weights():
    torch.manual_seed(0)
    m = _KwModel().train()
    x, lab = torch.randn(3, 4), torch.randint(0, 4, (3,))
    res = aotfuse.build(m, (x,), example_kwargs={"labels": lab}, train=True, targets=("sm_90",))
    assert res.manifest.call["loss_leaf"] == 0 and res.manifest.call["outputs"]["keys"] == ["loss", "y", "z"]
    mod = aotfuse.load(res.data, device="cpu").as_module()
    assert {n for n, _ in mod.named_parameters()} == {"a.weight", "a.bias", "b.bias"}  # the tied weight once
    x2, lab2 = torch.randn(3, 4), torch.randint(0, 4, (3,))
    loss = loss_of(mod(x2, labels=lab2))
    loss.backward()
    ref = copy.deepcopy(m)
    ref_loss = ref(x2, labels=lab2)["loss"]
    ref_loss.backward()
    assert _rel(loss, ref_loss) < 1e-5
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        assert _rel(ours[n].grad, p.grad) < 1e-5, n  # a.weight: the sum over both uses


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = x * self.w
        if (y > 0).all():  # a data-dependent branch
            y = y * 2
        return y.sum()


@pytest.mark.parametrize("train", [False, True])
def test_data_dependent_branch_is_refused_naming_the_line(train):
    with pytest.raises(BuildError, match=r"reads a tensor's value at .*test_zoo.py:\d+: if \(y > 0\).all\(\):") as ei:
        aotfuse.build(_Branchy(), (torch.randn(4),), train=train, targets=("sm_90",))
    assert "is_compiling" in str(ei.value) and "\n" not in str(ei.value)


def test_constant_causal_mask_is_folded():
    from aotfuse.export.fold import fold_unlowerable_constants

    class M(torch.nn.Module):
        def forward(self, x):
            ids = torch.arange(x.shape[-1]).expand(x.shape[0], -1)
            m = ids.cumsum(-1) >= 0  # constant, built with an op lowering has no rule for
            return torch.where(m, x, 0.0)

    ep = torch.export.export(M(), (torch.randn(2, 5),), strict=False)
    folded = fold_unlowerable_constants(ep.graph_module, lambda t: t is not torch.ops.aten.cumsum.default)
    assert len(folded) == 1 and folded[0][1].startswith("__folded__.") and bool(folded[0][2].all())
    assert not any(n.target is torch.ops.aten.cumsum.default for n in ep.graph_module.graph.nodes)
    res = aotfuse.build(M(), (torch.randn(2, 5),), targets=("sm_90",))
    x = torch.randn(2, 5)
    assert torch.equal(aotfuse.load(res.data, device="cpu")(x), M()(x))


def test_folded_empty_values_are_zeros():
    """A constant subgraph that starts from an uninitialized tensor (written only in part afterwards) is folded
    from zeros, so that the stored weight is the same from build to build (DeepSeek-V2's empty buffers did)."""
    from aotfuse.export.fold import fold_unlowerable_constants

    class M(torch.nn.Module):
        def forward(self, x):
            e = torch.empty(3, 5)  # rows 1 and 2 keep whatever the allocation held
            return x + torch.cat([torch.ones(1, 5), e[1:]]).cumsum(-1)

    for _ in range(2):
        ep = torch.export.export(M(), (torch.randn(3, 5),), strict=False)
        folded = fold_unlowerable_constants(ep.graph_module, lambda t: t is not torch.ops.aten.cumsum.default)
        (_, _, val), = folded
        assert torch.equal(val[1:], torch.zeros(2, 5)) and torch.equal(val[0], torch.arange(1.0, 6.0))


def test_models_doc_is_current():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_models_doc", root / "scripts" / "gen_models_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (root / "docs" / "models.md").read_text() == mod.render(), "run python3 scripts/gen_models_doc.py"
