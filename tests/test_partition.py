"""Joint graph + min-cut partition (CPU, eager): the split graphs reproduce the model's loss and
gradients, budgets move saved bytes monotonically, banned ops are never recomputed, bool masks
are bit-packed, and our partition keeps no more than torch's on the demo."""
from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from aotfuse.joint import trace_joint
from aotfuse.joint.decomp_train import training_decompositions
from aotfuse.partition import is_banned, op_class, partition
from aotfuse.partition.mincut import torch_min_cut_saved, torch_saved_bytes
from aotfuse.packops import PACK, UNPACK, pack_bits, packed_nbytes, unpack_bits
from aotfuse.specs import load_spec

DEMO = "aotfuse.examples.gpt:demo_train"
DEMO_NODROP = "aotfuse.examples.gpt:demo_train(dropout=0.0)"
LLAMA = "aotfuse.examples.llama:block_train"
CNN = "aotfuse.examples.cnn:cnn_train"
BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)

_CACHE: dict = {}


def _get(spec):
    if spec not in _CACHE:
        model, inputs = load_spec(spec)
        _CACHE[spec] = (model, inputs, trace_joint(model, inputs))
    return _CACHE[spec]


def _part(spec, budget=1.0):
    key = (spec, budget)
    if key not in _CACHE:
        _CACHE[key] = partition(_get(spec)[2], budget)
    return _CACHE[key]


def _run_split(joint, part, inputs, tangent=1.0, seed=None):
    args = joint.flat_args(inputs, tangent)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        fo = part.fwd_gm(*args[:-1])
        n = part.num_forward_outputs  # the user outputs, then buffer updates (none in these models)
        loss, saved = fo[part.loss_index], fo[n:]
        grads = part.bwd_gm(*saved, args[-1])
    return loss, list(grads), list(saved)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def _reference(model, inputs, joint, tangent=1.0):
    params = dict(model.named_parameters())
    loss = model(*inputs)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    grads = torch.autograd.grad(loss, [params[fqn] for kind, fqn in joint.grads],
                                grad_outputs=torch.full_like(loss, tangent))
    return loss.detach(), grads


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (13, 5), (3, 5, 7), (2, 1, 33), (0,), (1023,)])
def test_pack_unpack_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    b = torch.rand(shape, generator=g) < 0.5
    p = pack_bits(b)
    n = b.numel()
    assert p.dtype == torch.uint8 and tuple(p.shape) == (math.ceil(n / 8),) == (packed_nbytes(n),)
    assert torch.equal(unpack_bits(p, list(shape)), b)
    # bit layout: element j is bit j % 8 of byte j // 8
    flat = b.reshape(-1)
    for j in range(n):
        assert bool((int(p[j // 8]) >> (j % 8)) & 1) == bool(flat[j])
    if n % 8:
        assert int(p[-1]) >> (n % 8) == 0  # padding bits are zero


def test_pack_layout_and_strides():
    b = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(b).tolist() == [0b1101, 1]
    m = torch.rand(6, 5) < 0.3
    # a non-contiguous input is read in logical row-major order
    assert torch.equal(pack_bits(m.t()), pack_bits(m.t().contiguous()))
    assert torch.equal(unpack_bits(pack_bits(m.t()), [5, 6]), m.t())


def test_pack_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b = torch.empty(3, 5, 7, dtype=torch.bool)
        p = PACK(b)
        u = UNPACK(p, [3, 5, 7])
    assert p.dtype == torch.uint8 and tuple(p.shape) == (14,)
    assert u.dtype == torch.bool and tuple(u.shape) == (3, 5, 7)


# ---------------------------------------------------------------- joint graph

@pytest.mark.parametrize("spec", [DEMO, LLAMA, CNN])
def test_joint_signature(spec):
    model, inputs, joint = _get(spec)
    assert joint.tangent_mode == "seed"  # aot_autograd's ones_like seed became the tangent
    kinds = [k for _, k, _ in joint.placeholders]
    assert kinds[-1] == "tangent" and kinds.count("tangent") == 1
    tangent = next(n for n in joint.gm.graph.nodes if n.op == "placeholder" and n.name == joint.tangent)
    assert tuple(tangent.meta["val"].shape) == ()
    assert [f for k, f in joint.grads] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert set(joint.weights) == set(joint.param_names) | set(joint.buffer_names)
    ops = {n.target for n in joint.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.ones_like.default not in ops
    # attention is fused (aotfuse::attention and its backward); no other backward op is kept but the
    # library ones of the extern table (embedding's, convolution's: cuDNN dgrad/wgrad)
    kept = ("embedding_dense_backward", "convolution_backward", "aotfuse.attention")
    assert not any("flash" in str(t) or str(t).endswith("_backward.default") and not any(k in str(t) for k in kept)
                   for t in ops), sorted(map(str, ops))


def test_joint_input_ranges():
    assert [(s.name, s.low, s.high) for s in _get(DEMO)[2].inputs] == [("tokens", 0, 512), ("targets", 0, 512)]
    assert [(s.name, s.kind, s.low, s.high) for s in _get(CNN)[2].inputs][1] == ("labels", "int", 0, 10)


def test_joint_ops_lowerable():
    """Every op in the training graphs is lowerable, except the two the core engineer adds."""
    from aotfuse.lower import registry

    missing = collections.Counter()
    for spec in (DEMO, DEMO_NODROP, LLAMA, CNN):
        for n in _get(spec)[2].gm.graph.nodes:
            if n.op == "call_function" and n.target not in registry() and n.target.__name__ != "getitem":
                missing[str(n.target)] += 1
    assert set(missing) <= {"aten.cat.default", "aten.embedding_dense_backward.default", "aten.rand.default"}, missing


# ---------------------------------------------------------------- split graphs reproduce the model

@pytest.mark.parametrize("spec", [DEMO_NODROP, LLAMA, CNN])
@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_split_matches_autograd(spec, budget):
    model, inputs, joint = _get(spec)
    part = _part(spec, budget)
    ref_loss, ref_grads = _reference(model, inputs, joint)
    loss, grads, _ = _run_split(joint, part, inputs)
    assert _rel(loss, ref_loss) < 1e-5
    assert len(grads) == len(ref_grads)
    for (kind, fqn), g, r in zip(joint.grads, grads, ref_grads):
        assert g.shape == r.shape, fqn
        assert _rel(g, r) < 1e-5, (fqn, _rel(g, r))


@pytest.mark.parametrize("spec", [DEMO_NODROP, CNN])
def test_tangent_scales_gradients(spec):
    model, inputs, joint = _get(spec)
    part = _part(spec)
    _, g1, _ = _run_split(joint, part, inputs, tangent=1.0)
    loss2, g2, _ = _run_split(joint, part, inputs, tangent=2.0)
    _, r2 = _reference(model, inputs, joint, tangent=2.0)
    for a, b, r in zip(g1, g2, r2):
        assert _rel(b, 2 * a) < 1e-6
        assert _rel(b, r) < 1e-5


class _SameMaskDropout(TorchFunctionMode):
    """Eager dropout that draws its mask as the joint graph does: rand(x.shape) >= p, in call order."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if not training or p == 0:
                return x
            mask = torch.rand(x.shape, dtype=torch.float32) >= p
            return x * mask * (1.0 / (1.0 - p))
        return func(*args, **kwargs)


def test_dropout_split_uses_the_forward_mask():
    model, inputs, joint = _get(DEMO)
    part = _part(DEMO)
    rand = [n for n in part.fwd_gm.graph.nodes if n.target is torch.ops.aten.rand.default]
    assert len(rand) == 2 and not any(n.target is torch.ops.aten.rand.default for n in part.bwd_gm.graph.nodes)
    for seed in (0, 1):
        loss, grads, _ = _run_split(joint, part, inputs, tangent=1.0, seed=seed)
        # the joint graph, same seed: identical draws
        torch.manual_seed(seed)
        with torch.no_grad():
            jo = joint.gm(*joint.flat_args(inputs, 1.0))
        assert _rel(loss, jo[0]) < 1e-6
        for g, r in zip(grads, jo[joint.num_user_outputs:]):
            assert _rel(g, r) < 1e-5
        # eager autograd of the model with the same masks
        torch.manual_seed(seed)
        with _SameMaskDropout():
            ref_loss, ref_grads = _reference(model, inputs, joint)
        assert _rel(loss, ref_loss) < 1e-5
        for (kind, fqn), g, r in zip(joint.grads, grads, ref_grads):
            assert _rel(g, r) < 1e-5, (fqn, _rel(g, r))
    # and a different seed gives a different loss (the mask is really random)
    l0 = _run_split(joint, part, inputs, seed=0)[0]
    l1 = _run_split(joint, part, inputs, seed=1)[0]
    assert float(l0) != float(l1)


# ---------------------------------------------------------------- budgets, bans, packing

@pytest.mark.parametrize("spec", [DEMO, LLAMA, CNN])
def test_saved_bytes_monotone_in_budget(spec):
    got = [_part(spec, b).saved_bytes for b in BUDGETS]
    assert got == sorted(got), got
    assert got[0] <= got[-1]


@pytest.mark.parametrize("spec", [DEMO, LLAMA, CNN])
@pytest.mark.parametrize("budget", BUDGETS)
def test_banned_never_recomputed(spec, budget):
    joint = _get(spec)[2]
    part = _part(spec, budget)
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    for name in part.recomputed:
        node = by_name[name]
        assert not is_banned(node), (name, node.target)
        assert op_class(node) not in ("extern", "random", "unknown")
    for n in part.bwd_gm.graph.nodes:
        if n.op == "call_function" and n.name in by_name and n.name in part.recomputed:
            assert op_class(n) not in ("extern", "random")


@pytest.mark.parametrize("spec", [DEMO, CNN])
def test_saved_report_and_packing(spec):
    model, inputs, joint = _get(spec)
    part = _part(spec)
    rep = part.report()
    assert rep["saved_bytes"] == part.saved_bytes == sum(s.nbytes for s in part.saved if s.kind == "activation")
    assert rep["memory_budget"] == 1.0 and len(rep["recomputed"]) == len(part.recomputed)
    for s in rep["saved"]:
        assert s["why"] and s["producer_op"] and s["nbytes"] >= 0
    fout = list(next(n for n in part.fwd_gm.graph.nodes if n.op == "output").args[0])[part.num_user_outputs:]
    assert len(fout) == len(part.saved)
    _, _, saved_vals = _run_split(joint, part, inputs, seed=0)
    bwd_ph = [n for n in part.bwd_gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in bwd_ph][-1] == joint.tangent and len(bwd_ph) == len(part.saved) + 1
    n_packed = 0
    for s, node, val in zip(part.saved, fout, saved_vals):
        if s.packed:
            n_packed += 1
            numel = math.prod(s.shape)
            assert s.dtype == "bool" and s.nbytes == math.ceil(numel / 8)
            assert node.target is PACK
            assert node.meta["val"].dtype == torch.uint8 and tuple(node.meta["val"].shape) == (s.nbytes,)
            assert val.dtype == torch.uint8 and tuple(val.shape) == (math.ceil(numel / 8),)
        else:
            assert s.dtype != "bool" or math.prod(s.shape) < 2
            assert val.dtype != torch.uint8 or s.dtype == "uint8"
    unpacks = [n for n in part.bwd_gm.graph.nodes if n.target is UNPACK]
    assert len(unpacks) == n_packed
    if spec == DEMO:
        assert n_packed >= 2  # the two dropout keep masks


def test_ours_no_more_than_torch_on_demo():
    joint = _get(DEMO)[2]
    ours = _part(DEMO).saved_bytes
    raw, alive = torch_saved_bytes(torch_min_cut_saved(joint))
    assert ours <= alive <= raw, (ours, alive, raw)


# ---------------------------------------------------------------- decompositions vs ATen, eagerly

def _decomp(op):
    from aotfuse.joint.decomp_train import TRAIN

    return TRAIN[op]


def _close(a, b, tol=1e-5):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert _rel(a, b) < tol, _rel(a, b)


aten = torch.ops.aten


def test_decomp_norms_and_activations():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 10, generator=g)
    go = torch.randn(4, 6, 10, generator=g)
    w, b = torch.randn(10, generator=g), torch.randn(10, generator=g)
    _, mean, rstd = aten.native_layer_norm(x, [10], w, b, 1e-5)
    for wb, mask in (((w, b), [True, True, True]), ((None, None), [True, False, False])):
        ref = aten.native_layer_norm_backward(go, x, [10], mean, rstd, *wb, mask)
        got = _decomp(aten.native_layer_norm_backward.default)(go, x, [10], mean, rstd, *wb, mask)
        for a, r in zip(got, ref):
            _close(a, r)
    _, mean2, rstd2 = aten.native_layer_norm(x, [6, 10], None, None, 1e-5)
    ref = aten.native_layer_norm_backward(go, x, [6, 10], mean2, rstd2, None, None, [True, False, False])
    _close(_decomp(aten.native_layer_norm_backward.default)(go, x, [6, 10], mean2, rstd2, None, None,
                                                            [True, False, False])[0], ref[0])
    for approx in ("none", "tanh"):
        _close(_decomp(aten.gelu_backward.default)(go, x, approximate=approx),
               aten.gelu_backward(go, x, approximate=approx))
    y = torch.sigmoid(x)
    _close(_decomp(aten.sigmoid_backward.default)(go, y), aten.sigmoid_backward(go, y))
    t = torch.tanh(x)
    _close(_decomp(aten.tanh_backward.default)(go, t), aten.tanh_backward(go, t))
    _close(_decomp(aten.silu_backward.default)(go, x), aten.silu_backward(go, x))
    _close(_decomp(aten.threshold_backward.default)(go, x, 0.3), aten.threshold_backward(go, x, 0.3))
    sm = torch.softmax(x, 1)
    _close(_decomp(aten._softmax_backward_data.default)(go, sm, 1, torch.float32),
           aten._softmax_backward_data(go, sm, 1, torch.float32))
    ls = torch.log_softmax(x, -1)
    _close(_decomp(aten._log_softmax_backward_data.default)(go, ls, -1, torch.float32),
           aten._log_softmax_backward_data(go, ls, -1, torch.float32))
    # half inputs: fp32 math, half result
    xh, goh = x.to(torch.bfloat16), go.to(torch.bfloat16)
    got = _decomp(aten.gelu_backward.default)(goh, xh)
    assert got.dtype == torch.bfloat16
    _close(got, aten.gelu_backward(goh, xh), tol=1e-2)


@pytest.mark.parametrize("train", [False, True])
def test_decomp_batch_norm_backward(train):
    g = torch.Generator().manual_seed(1)
    x, go = torch.randn(3, 5, 4, 4, generator=g), torch.randn(3, 5, 4, 4, generator=g)
    w = torch.randn(5, generator=g)
    rm, rv = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.5
    if train:
        sm = x.mean((0, 2, 3))
        sinv = torch.rsqrt(x.var((0, 2, 3), unbiased=False) + 1e-5)
    else:
        sm = sinv = None
    ref = aten.native_batch_norm_backward(go, x, w, rm, rv, sm, sinv, train, 1e-5, [True, True, True])
    got = _decomp(aten.native_batch_norm_backward.default)(go, x, w, rm, rv, sm, sinv, train, 1e-5,
                                                          [True, True, True])
    for a, r in zip(got, ref):
        _close(a, r, tol=1e-4)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_decomp_nll_loss(reduction, weighted):
    g = torch.Generator().manual_seed(2)
    x = torch.log_softmax(torch.randn(9, 7, generator=g), 1)
    t = torch.randint(0, 7, (9,), generator=g)
    t[2] = t[5] = -100
    w = torch.rand(7, generator=g) + 0.5 if weighted else None
    ref_out, ref_tw = aten.nll_loss_forward(x, t, w, reduction, -100)
    out, tw = _decomp(aten.nll_loss_forward.default)(x, t, w, reduction, -100)
    _close(out, ref_out)
    if reduction != 0:
        _close(tw, ref_tw)
    go = torch.randn(ref_out.shape, generator=g)
    _close(_decomp(aten.nll_loss_backward.default)(go, x, t, w, reduction, -100, ref_tw),
           aten.nll_loss_backward(go, x, t, w, reduction, -100, ref_tw))
    # an ignore_index inside [0, C)
    ref = aten.nll_loss_forward(x, t.clamp(min=0), w, reduction, 3)
    got = _decomp(aten.nll_loss_forward.default)(x, t.clamp(min=0), w, reduction, 3)
    _close(got[0], ref[0])
    # unbatched
    ref = aten.nll_loss_forward(x[0], t[0], w, reduction, -100)
    _close(_decomp(aten.nll_loss_forward.default)(x[0], t[0], w, reduction, -100)[0], ref[0])
    go0 = torch.randn(ref[0].shape, generator=g)
    _close(_decomp(aten.nll_loss_backward.default)(go0, x[0], t[0], w, reduction, -100, ref[1]),
           aten.nll_loss_backward(go0, x[0], t[0], w, reduction, -100, ref[1]))


def test_decomp_mse_and_dropout():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    for red in (0, 1, 2):
        _close(_decomp(aten.mse_loss.default)(x, y, red), aten.mse_loss(x, y, red))
        go = torch.randn(aten.mse_loss(x, y, red).shape, generator=g)
        _close(_decomp(aten.mse_loss_backward.default)(go, x, y, red), aten.mse_loss_backward(go, x, y, red))
    torch.manual_seed(0)
    out, mask = _decomp(aten.native_dropout.default)(x, 0.25, True)
    torch.manual_seed(0)
    assert torch.equal(mask, torch.rand(x.shape) >= 0.25)
    _close(out, x * mask / 0.75)
    go = torch.randn(4, 5, generator=g)
    _close(_decomp(aten.native_dropout_backward.default)(go, mask, 1 / 0.75),
           aten.native_dropout_backward(go, mask, 1 / 0.75))


def test_decomp_max_pool_backward_ties():
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 3, (2, 3, 8, 6), generator=g).float()  # many ties
    out, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    go = torch.randn(out.shape, generator=g)
    ref = aten.max_pool2d_with_indices_backward(go, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
    got = _decomp(aten.max_pool2d_with_indices_backward.default)(go, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
    assert torch.equal(got, ref)
    # overlapping windows: not decomposed
    assert _decomp(aten.max_pool2d_with_indices_backward.default)(go, x, [3, 3], [2, 2], [0, 0], [1, 1], False,
                                                                  idx) is NotImplemented


@pytest.mark.parametrize("stride,padding,dilation", [(1, 1, 1), (2, 1, 1), (2, 0, 2), (3, 2, 1)])
def test_convolution_backward_is_kept_whole_and_its_result_rule_matches_aten(stride, padding, dilation):
    """The joint trace keeps convolution_backward (cuDNN dgrad/wgrad): the runtime validates each call with
    a written-out rule of its results (what output_mask asks for), which must agree with aten."""
    from aotfuse.errors import ArchiveError
    from aotfuse.runtime.validate_extern import _Ref, _convolution_backward_results

    assert aten.convolution_backward.default not in training_decompositions()
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 3, 11, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    args = ([stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], 1)
    y = aten.convolution(x, w, None, *args)
    go = torch.randn(y.shape, generator=g)

    def ref_of(t):
        return _Ref("t", "float32", tuple(t.shape), tuple(t.stride()))
    for mask in ([True, True, True], [False, True, False], [True, False, False]):
        ref = [r for r in aten.convolution_backward(go, x, w, [4], *args, mask) if r is not None]
        got = _convolution_backward_results([ref_of(go), ref_of(x), ref_of(w), [4], *map(list, args[:3]), args[3],
                                             [0, 0], 1, mask], {}, "test")
        assert [(d, list(s)) for d, s in got] == [("float32", list(r.shape)) for r in ref]
    bad = torch.randn(2, 4, y.shape[2] + 1, y.shape[3])
    with pytest.raises(ArchiveError, match="does not match"):
        _convolution_backward_results([ref_of(bad), ref_of(x), ref_of(w), [4], *map(list, args[:3]), False, [0, 0], 1,
                                       [True, True, True]], {}, "test")


@pytest.mark.parametrize("case", ["causal", "plain", "bool_mask", "float_mask", "gqa", "scale"])
def test_sdpa_math(case):
    from aotfuse.joint.decomp_train import sdpa_math

    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 4, 7, 8, generator=g), torch.randn(2, 4, 7, 6, generator=g)
    kw = {}
    if case == "causal":
        k, v = k[:, :, :5], v[:, :, :5]
        kw = {"is_causal": True}
    elif case == "bool_mask":
        m = torch.rand(5, 7, generator=g) > 0.3
        m[:, 0] = True
        kw = {"attn_mask": m}
    elif case == "float_mask":
        kw = {"attn_mask": torch.randn(2, 1, 5, 7, generator=g)}
    elif case == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw = {"enable_gqa": True}
    elif case == "scale":
        kw = {"scale": 0.3}
    _close(sdpa_math(q, k, v, **kw), torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))


def _assert_splits_match(model, inputs, joint, parts):
    """Each partition's split graphs give eager's loss (1e-6) and gradients (1e-5)."""
    ref_loss, ref_grads = _reference(model, inputs, joint)
    for part in parts:
        loss, grads, _ = _run_split(joint, part, inputs)
        assert _rel(loss, ref_loss) < 1e-6
        for g, r in zip(grads, ref_grads):
            assert _rel(g, r) < 1e-5


def test_materialize_knob_saves_what_a_backward_matmul_reads():
    """partition_materialize: a tanh GELU's output feeds the weight-gradient matmul of the next Linear; as a
    recompute it would be written again in the backward, so the charged cut saves it at budget 1 (and still
    recomputes it at budget 0); off (the default) it is recomputed. The split graphs compute eager's
    gradients either way."""
    import torch.nn as nn
    import torch.nn.functional as F

    from aotfuse.knobs import override

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(32, 128), nn.Linear(128, 32)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x), approximate="tanh")).pow(2).mean()

    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(64, 32)
    joint = trace_joint(model, (x,))

    def gelu_saved(part):
        return any(s.kind == "activation" and tuple(s.shape) == (64, 128) and s.producer_op != "aten.addmm"
                   and "mm" not in s.producer_op for s in part.saved)

    off = partition(joint, 1.0)
    with override(partition_materialize=True):
        on, lean = partition(joint, 1.0), partition(joint, 0.0)
    assert not gelu_saved(off) and gelu_saved(on) and not gelu_saved(lean)
    assert on.saved_bytes > off.saved_bytes >= lean.saved_bytes
    _assert_splits_match(model, (x,), joint, (off, on))


class _FusedQKV(torch.nn.Module):
    """One matmul for q, k and v (Phi-3's qkv_proj); q and k are rotated (a cat, saved as the attention's operands),
    so of the matmul's result the backward needs only v, a third of it."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, -1)
        rot = lambda z: torch.cat([z[..., :8] * 2, z[..., 8:]], -1)  # noqa: E731
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (rot(q), rot(k), v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).mean()


def test_a_view_the_backward_reads_is_saved_as_a_dense_copy_not_its_base():
    """knobs.partition_view_copies: v (a column slice of the QKV product) saved as a dense copy, 1.5x its bytes,
    instead of the whole product; the forward makes the copy, the backward reads a row-major placeholder, and the
    split graphs compute eager's gradients. Off, the product is saved."""
    from aotfuse.knobs import override

    torch.manual_seed(0)
    model, x = _FusedQKV(), torch.randn(2, 8, 16)
    joint = trace_joint(model, (x,))
    on = partition(joint, 1.0)
    with override(partition_view_copies=False):
        off = partition(joint, 1.0)
    copies = [s for s in on.saved if s.copied]
    assert len(copies) == 1 and tuple(copies[0].shape) == (2, 2, 8, 8) and "dense copy" in copies[0].why
    assert not any(tuple(s.shape) == (16, 48) for s in on.saved if s.kind == "activation")
    assert any(tuple(s.shape) == (16, 48) for s in off.saved if s.kind == "activation")
    assert not any(s.copied for s in off.saved)
    assert on.saved_bytes < off.saved_bytes
    ph = next(n for n in on.bwd_gm.graph.nodes if n.op == "placeholder" and n.name == copies[0].name)
    assert ph.meta["val"].is_contiguous()
    _assert_splits_match(model, (x,), joint, (on, off))


class _SwiGLU(torch.nn.Module):
    def __init__(self, d=16, layers=3):
        super().__init__()
        self.gate = torch.nn.ModuleList(torch.nn.Linear(d, 4 * d) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(d, 4 * d) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * d, d) for _ in range(layers))

    def forward(self, x):
        for g, u, dn in zip(self.gate, self.up, self.down):
            x = x + dn(torch.nn.functional.silu(g(x)) * u(x))
        return x.pow(2).mean()


class _SiLUMLP(torch.nn.Module):
    """Linear + SiLU layers in bf16: the backward recomputes each SiLU as a diamond (the saved bf16 input cast to
    fp32 feeds both the sigmoid and the product, cast back to bf16 for the next layer's weight gradient), as
    EfficientNet's swish does."""

    def __init__(self, d=16, layers=4):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for lin in self.lins:
            x = lin(torch.nn.functional.silu(x))
        return x.float().pow(2).mean()


@pytest.mark.parametrize("case", ["swiglu", "silu_diamond_bf16"])
def test_recomputations_sit_just_before_their_first_reader(case):
    """partition/sink.py: each layer's recomputed SwiGLU product (or bf16 SiLU, whose recomputation is a diamond)
    is computed where the backward first reads it (only other tangent-free nodes of its own chain in between),
    not all at the top of the backward."""
    torch.manual_seed(0)
    if case == "swiglu":
        model, x = _SwiGLU(), torch.randn(32, 16)
    else:
        model, x = _SiLUMLP().to(torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    joint = trace_joint(model, (x,))
    part = partition(joint, 1.0)
    nodes = list(part.bwd_gm.graph.nodes)
    tangent = next(n for n in nodes if n.op == "placeholder" and n.name == joint.tangent)
    dep = {tangent}
    for n in nodes:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    free = [n for n in nodes if n.op == "call_function" and n not in dep and n.users]
    muls = [n for n in free if n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) >= 3  # the products, recomputed
    for n in free:
        first = min(nodes.index(u) for u in n.users)
        between = nodes[nodes.index(n) + 1:first]
        assert all(b not in dep for b in between), (n.name, [b.name for b in between if b in dep][:3])
    ref_loss, ref_grads = _reference(model, (x,), joint)
    loss, grads, _ = _run_split(joint, part, (x,))
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < (1e-5 if case == "swiglu" else 1e-2)


def test_a_dense_copy_of_a_view_through_the_archive_matches_eager():
    """The copied view lowered and run (CPU interpreter): the forward's copy kernel writes it row-major, the
    backward's attention reads it from there; loss and gradients as eager's."""
    import copy

    import aotfuse
    from aotfuse.bench import verify_train

    torch.manual_seed(0)
    model = _FusedQKV()
    res = aotfuse.build(model, (torch.randn(2, 8, 16),), train=True, targets=("sm_90",))
    assert any(s.get("copied") for s in res.report.partition["saved"])
    art = aotfuse.load(res.data, device="cpu")
    checks = verify_train(copy.deepcopy(model), art, [torch.randn(2, 8, 16)])
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]


class _EmptyPassThrough(torch.nn.Module):
    """A rotary-style split whose pass-through part is empty (rotary_dim == head_dim, Phi-3)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return torch.cat([torch.tanh(h[..., :8]), h[..., 8:]], -1).pow(2).mean()


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_an_empty_view_is_never_saved_as_a_copy(budget):
    """An empty view costs nothing to keep, so a zero-cost copy edge made the cut save it and lowering refuse the
    empty tensor; it is recomputed (free) and the archive builds and trains as eager does."""
    import copy

    import aotfuse
    from aotfuse.bench import verify_train
    torch.manual_seed(0)
    model, x = _EmptyPassThrough(), torch.randn(4, 8)
    part = partition(trace_joint(model, (x,)), budget)
    assert not any(s.copied for s in part.saved)
    res = aotfuse.build(model, (x,), train=True, targets=("sm_90",), memory_budget=budget)
    checks = verify_train(copy.deepcopy(model), aotfuse.load(res.data, device="cpu"), [torch.randn(4, 8)])
    assert checks and all(c.passed for c in checks)


def test_a_wide_group_of_recomputations_sinks_whole():
    """A reader of 70 single-reader recomputed inputs (a cat) moves with all of them past the tangent's work: the
    group is not cut at a size where its remaining inputs would be held from the top (review of the sink's groups)."""
    from aotfuse.partition.sink import sink_recomputation

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("t")
    parts = [g.call_function(aten.mul.Tensor, (x, float(i + 1))) for i in range(70)]
    cat = g.call_function(aten.cat.default, (parts,))
    d = t
    for _ in range(5):
        d = g.call_function(aten.relu.default, (d,))
    g.output((g.call_function(aten.add.Tensor, (cat, d)),))
    sink_recomputation(g, t)
    order = list(g.nodes)
    assert order.index(d) < min(order.index(p) for p in parts) and order.index(cat) > order.index(d)
    g.lint()
