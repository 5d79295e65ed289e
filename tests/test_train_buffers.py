"""Train-mode BatchNorm (issue 8): buffer updates returned by the forward program and written back by the
runtime, as torch.export represents buffer mutations.

Small conv + BatchNorm models (2d, 1d on [N, C, L] and on [N, C], momentum 0.1 and momentum=None,
affine=False, track_running_stats=False: batch statistics with no buffer to update) are
built once each and trained for several SGD steps on fresh random inputs next to an eager copy: the
loss, every gradient, and running_mean / running_var / num_batches_tracked after every step. Then:
a buffer the forward both reads (for the backward) and updates, the state_dict round trip, the train
info in the archive and in `inspect` / `explain`, eval-mode BatchNorm (buffers stay constants), the
refusal of an in-place update of an input or a parameter, and the archive checks of the new field.

Kernels are not compiled to cubins here (the CPU path runs their Triton source; tests/test_zoo.py's
ResNets build for real).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import aotfuse
from aotfuse.cli import app
from aotfuse.contract import TrainInfo
from aotfuse.errors import AotfuseError, ArchiveError, BuildError

STEPS = 3


def _fake_compile(kernels, targets, workers, progress=None):
    """The CPU path never reads cubins: skip Triton's compiler, keep the build's real metadata."""
    from aotfuse.emit.compile import Binary

    return {k.name: {"sm_90": Binary("sm_90", b"not-a-cubin", k.name, k.num_warps, 0, 0, 0)} for k in kernels}


@pytest.fixture(scope="module", autouse=True)
def _no_cubins():
    mp = pytest.MonkeyPatch()
    mp.setattr("aotfuse.pipeline.compile_all", _fake_compile)
    yield
    mp.undo()


# ---------------------------------------------------------------- models

class ConvBN2d(nn.Module):
    def __init__(self, momentum=0.1, **bn):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6, momentum=momentum, **bn)
        self.conv2 = nn.Conv2d(6, 4, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum, **bn)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.flatten(1)), y)


class ConvBN1d(nn.Module):
    """BatchNorm1d on [N, C, L] (conv features) and on [N, C] (after a linear layer)."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3)
        self.bn = nn.BatchNorm1d(6, momentum=momentum)
        self.fc = nn.Linear(6 * 8, 16)
        self.bn_fc = nn.BatchNorm1d(16, momentum=momentum)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return F.cross_entropy(self.head(torch.relu(self.bn_fc(self.fc(h)))), y)


def _images(g):
    return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)


CASES = {  # name -> (model factory, input factory: generator -> (x, y))
    "bn2d": (lambda: ConvBN2d(), _images),
    "bn1d": (lambda: ConvBN1d(), lambda g: (torch.randn(4, 3, 10, generator=g), torch.randint(0, 5, (4,), generator=g))),
    "bn2d_cma": (lambda: ConvBN2d(momentum=None), _images),  # cumulative moving average: factor 1/num_batches_tracked
    "bn2d_no_affine": (lambda: ConvBN2d(affine=False), _images),
    "bn2d_no_stats": (lambda: ConvBN2d(track_running_stats=False), _images),  # batch statistics, no buffers
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = CASES[name][0]()
    with torch.no_grad():  # start from non-trivial statistics (not zeros and ones)
        for mod in m.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.num_batches_tracked.fill_(3)
    return m.train()


def _inputs(name: str, seed: int):
    return CASES[name][1](torch.Generator().manual_seed(seed))


_BUILT: dict = {}


def _built(name: str):
    """(eager model at build time, BuildResult), built once per module."""
    if name not in _BUILT:
        m = _model(name)
        _BUILT[name] = (m, aotfuse.build(m, _inputs(name, 0), train=True, targets=("sm_90",)))
    return _BUILT[name]


def _rel(a, b, floor: float = 1e-30) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), floor))


def _bn_buffers(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_buffers()]


def _check_buffers(mod, ref, where: str):
    ours, theirs = dict(mod.named_buffers()), dict(ref.named_buffers())
    assert set(ours) == set(theirs), where
    for n, b in ours.items():
        if b.is_floating_point():
            assert _rel(b, theirs[n]) < 1e-5, f"{where}: {n}: {_rel(b, theirs[n]):.2e}"
        else:
            assert b.dtype == theirs[n].dtype and torch.equal(b, theirs[n]), f"{where}: {n}: {b} vs {theirs[n]}"


def _step_both(mod, ref, opt, ref_opt, inputs, where: str):
    for o in (opt, ref_opt):
        o.zero_grad(set_to_none=True)
    loss = mod(*inputs)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    assert _rel(loss, ref_loss) < 1e-5, (where, float(loss), float(ref_loss))
    ours = dict(mod.named_parameters())
    grads = {n: p.grad for n, p in ref.named_parameters()}
    # a gradient that is zero in exact arithmetic (the bias of a conv/linear right before BatchNorm: the
    # batch mean removes it) is rounding noise, judged against the other gradients' scale
    floor = 1e-2 * max(float(g.double().norm()) for g in grads.values())
    for n, g in grads.items():
        assert ours[n].grad is not None, (where, n)
        assert _rel(ours[n].grad, g, floor) < 1e-4, f"{where}: grad of {n}: {_rel(ours[n].grad, g, floor):.2e}"
    _check_buffers(mod, ref, where)  # written back by the forward, before the optimizer step
    opt.step()
    ref_opt.step()


# ---------------------------------------------------------------- training vs eager

@pytest.mark.parametrize("name", list(CASES))
def test_training_steps_match_eager(name):
    model, res = _built(name)
    assert res.manifest.train.mutated_buffers == tuple(_bn_buffers(model))
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    _check_buffers(mod, ref, "after load")  # the archive's buffers: the model's at build time
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    before = {n: b.clone() for n, b in mod.named_buffers()}
    for step in range(STEPS):
        _step_both(mod, ref, opt, ref_opt, _inputs(name, 100 + step), f"{name} step {step + 1}")
        if step == 0:
            for n, b in mod.named_buffers():  # the statistics moved (and the counter counted)
                assert not torch.equal(b, before[n]), n
    counts = {n: int(b) for n, b in mod.named_buffers() if n.endswith("num_batches_tracked")}
    assert set(counts.values()) == (set() if name == "bn2d_no_stats" else {3 + STEPS})


def test_momentum_none_is_a_cumulative_average():
    """momentum=None: the factor is 1 / num_batches_tracked, read from the buffer at run time, not
    the value it had at build time."""
    model, res = _built("bn2d_cma")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    with torch.no_grad():
        dict(mod.named_buffers())["bn.num_batches_tracked"].fill_(0)  # first batch: the average is the batch's
        dict(mod.named_buffers())["bn.running_mean"].fill_(123.0)
    x, y = _inputs("bn2d_cma", 7)
    mod(x, y)
    batch_mean = model.conv(x).detach().mean((0, 2, 3))
    got = dict(mod.named_buffers())
    assert int(got["bn.num_batches_tracked"]) == 1
    assert _rel(got["bn.running_mean"], batch_mean) < 1e-5


def test_buffer_read_by_the_backward_and_updated():
    """The backward needs the value the forward read; the runtime overwrites the buffer after the
    forward: the partition saves a copy (kind buffer_copy), never the buffer itself."""

    class ReadUpdate(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5))
            self.register_buffer("scale", torch.rand(5) + 0.5)

        def forward(self, x):
            before = self.scale.clone()  # read before the update: the backward multiplies by it
            y = (x * self.w * before).sum()
            self.scale.mul_(0.9).add_(0.1 * x.detach().mean(0))
            return y + (x * self.w * self.scale).sum()  # read after it

    torch.manual_seed(0)
    model = ReadUpdate().train()
    x0 = torch.randn(3, 5).requires_grad_()
    res = aotfuse.build(model, (x0,), train=True, targets=("sm_90",))
    assert res.manifest.train.mutated_buffers == ("scale",)
    kinds = {s["name"]: s["kind"] for s in res.report.partition["saved"]}
    assert kinds.get("b_scale") == "buffer_copy", kinds
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    for step in range(STEPS):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(step + 1)).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        loss, ref_loss = mod(x), ref(xr)
        loss.backward()
        ref_loss.backward()
        assert _rel(loss, ref_loss) < 1e-5
        assert _rel(dict(mod.named_parameters())["w"].grad, ref.w.grad) < 1e-5
        assert _rel(x.grad, xr.grad) < 1e-5
        _check_buffers(mod, ref, f"step {step + 1}")
        for p in (dict(mod.named_parameters())["w"], ref.w):
            p.grad = None


def test_several_forwards_before_their_backwards():
    """Each forward reads the statistics the previous one wrote; its backward uses its own batch."""
    model, res = _built("bn2d")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    batches = [_inputs("bn2d", 40 + i) for i in range(2)]
    losses = [mod(*b) for b in batches]
    ref_losses = [ref(*b) for b in batches]
    _check_buffers(mod, ref, "after two forwards")
    (losses[0] + 2 * losses[1]).backward()
    (ref_losses[0] + 2 * ref_losses[1]).backward()
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        assert _rel(ours[n].grad, p.grad, 1e-2 * float(ref.head.weight.grad.norm())) < 1e-4, n


# ---------------------------------------------------------------- state

def test_state_dict_round_trip():
    model, res = _built("bn2d")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        mod(*_inputs("bn2d", 60 + step)).backward()
        opt.step()
    state = mod.state_dict()
    # the original model's names, parameters and buffers alike (parameters first): it loads into the eager model
    assert set(state) == set(model.state_dict()) and list(state)[:len(list(mod.parameters()))] == \
        [n for n, _ in model.named_parameters()]
    eager = copy.deepcopy(model)
    eager.load_state_dict(state)
    for n, t in eager.state_dict().items():
        assert torch.equal(t, state[n]), n
    # and into a fresh packaged module: the same next step
    other = aotfuse.load(res.data, device="cpu").as_module()
    assert not torch.equal(dict(other.named_buffers())["bn.running_mean"], state["bn.running_mean"])
    other.load_state_dict(state)
    for n, t in other.state_dict().items():
        assert torch.equal(t, state[n]), n
    x, y = _inputs("bn2d", 70)
    loss, other_loss, eager_loss = mod(x, y), other(x, y), eager(x, y)
    assert torch.equal(other_loss, loss)
    assert _rel(loss, eager_loss) < 1e-5
    _check_buffers(other, mod, "reloaded, one more call")
    _check_buffers(mod, eager, "eager loaded from the packaged state, one more call")


def test_buffers_follow_the_module():
    model, res = _built("bn1d")
    mod = aotfuse.load(res.data, device="cpu").as_module()
    assert [n for n, _ in mod.named_buffers()] == _bn_buffers(model)
    assert len(list(mod.buffers())) == len(_bn_buffers(model))
    assert all(not b.requires_grad for b in mod.buffers())
    mod.double().float()  # .to() replaces buffer tensors: the next call must use the new ones
    x, y = _inputs("bn1d", 80)
    mod(x, y)
    ref = copy.deepcopy(model)
    ref(x, y)
    _check_buffers(mod, ref, "after .to()")


# ---------------------------------------------------------------- archive, inspect, explain

def test_train_info_lists_the_updated_buffers(tmp_path):
    model, res = _built("bn2d")
    names = tuple(_bn_buffers(model))
    info = res.manifest.train
    assert info.mutated_buffers == names and not set(names) & set(info.buffers)
    assert info.state_inputs == info.params + names
    art = aotfuse.load(res.data, device="cpu")
    assert art.manifest.train.mutated_buffers == names
    fwd = art.programs["forward"]
    n_p = len(info.params)
    assert len(fwd.inputs) == n_p + len(names) + len(info.user_inputs)  # parameters, buffers, inputs
    assert len(fwd.returned) == 1 + len(names) + info.n_saved  # loss, buffer updates, saved tensors
    for i, n in enumerate(names):  # each update has its buffer's shape and dtype; no baked copy of the buffer
        w = art.weights[n]
        assert list(fwd.inputs[n_p + i].shape) == list(w.shape) and fwd.inputs[n_p + i].dtype == str(w.dtype)[6:]
        assert n not in fwd.weights.values()
    # a plain call of a train archive computes the loss from the archive's statistics and keeps nothing
    x, y = _inputs("bn2d", 5)
    assert _rel(art(x, y), copy.deepcopy(model)(x, y)) < 1e-5
    assert torch.equal(art.weights["bn.running_mean"], model.bn.running_mean)

    path = tmp_path / "bn.aotf"
    res.save(path)
    js = aotfuse.inspect_archive(str(path))
    assert js["train"]["mutated_buffers"] == list(names)
    runner = CliRunner()
    text = runner.invoke(app, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    assert "buffers updated by the forward (written back by the runtime): " + ", ".join(names) in text.stdout
    assert json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)["train"]["mutated_buffers"] == list(names)
    ex = runner.invoke(app, ["explain", str(path)])
    assert ex.exit_code == 0, ex.output
    for n in names:
        assert f"buffer update {n}: " in ex.stdout, n
    assert res.report.partition["buffer_updates"][0]["buffer"] == names[0]


def test_archives_without_updated_buffers_keep_their_train_info():
    """An archive written before the field (or with no updated buffers) has no key: the default."""
    d = TrainInfo(("w",), (), (), (("param", "w"),), 1, 4).to_dict()
    assert "mutated_buffers" not in d
    assert TrainInfo.from_dict(d).mutated_buffers == ()
    full = TrainInfo(("w",), (), (), (("param", "w"),), 1, 4, mutated_buffers=("bn.running_mean",))
    assert TrainInfo.from_dict(full.to_dict()) == full


def _rewrite(data: bytes, edit) -> bytes:
    from aotfuse.archive import read_archive, write_archive

    ar = read_archive(data)
    manifest = copy.deepcopy(ar.manifest)
    edit(manifest)
    return write_archive(manifest, {n: ar.part(n) for n in ar.part_names}, dict(ar.weights))


def test_updated_buffers_are_checked_at_load():
    _, res = _built("bn2d")
    for edit, match in [
        (lambda m: m["train"].pop("mutated_buffers"), r"forward program's inputs"),
        (lambda m: m["train"]["mutated_buffers"].reverse(), r"mutated_buffers|forward program's inputs"),
        (lambda m: m["train"]["mutated_buffers"].__setitem__(0, "nope"), r"buffer 'nope' is not a usable weight"),
        (lambda m: m["train"]["mutated_buffers"].append(m["train"]["params"][0]), r"names a buffer twice, or a parameter"),
        (lambda m: m["train"].__setitem__("mutated_buffers", "bn"), r"mutated_buffers"),
    ]:
        with pytest.raises(ArchiveError, match=match):
            aotfuse.load(_rewrite(res.data, edit), device="cpu")


# ---------------------------------------------------------------- eval mode, refusals

def test_eval_mode_batchnorm_keeps_constant_statistics():
    model = _model("bn2d").eval()
    res = aotfuse.build(model, _inputs("bn2d", 0), train=True, targets=("sm_90",))
    info = res.manifest.train
    assert info.mutated_buffers == () and {"bn.running_mean", "bn.running_var"} <= set(info.buffers)
    mod = aotfuse.load(res.data, device="cpu").as_module()
    assert list(mod.named_buffers()) == []
    ref = copy.deepcopy(model)
    x, y = _inputs("bn2d", 9)
    loss, ref_loss = mod(x, y), ref(x, y)
    loss.backward()
    ref_loss.backward()
    assert _rel(loss, ref_loss) < 1e-5
    ours = dict(mod.named_parameters())
    for n, p in ref.named_parameters():
        assert _rel(ours[n].grad, p.grad, 1e-2 * float(ref.head.weight.grad.norm())) < 1e-4, n
    for n, b in ref.named_buffers():  # eval mode: nothing moved
        assert torch.equal(b, dict(model.named_buffers())[n])


class _InputScaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, offsets, x):
        offsets.add_(1.0)  # writes into the caller's tensor
        return ((x + offsets) * self.w).sum()


def test_in_place_update_of_an_input_is_refused_by_name():
    with pytest.raises(BuildError, match=r"writes into its input\(s\) 'offsets' in place") as ei:
        aotfuse.build(_InputScaler().train(), (torch.randn(5), torch.randn(5)), train=True, targets=("sm_90",))
    assert "clone" in str(ei.value)


def test_in_place_update_of_a_parameter_is_refused_by_name():
    class Clamp(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5))

        def forward(self, x):
            with torch.no_grad():
                self.w.clamp_(-1.0, 1.0)  # a projection step inside the forward
            return (x * self.w).sum()

    with pytest.raises(BuildError, match=r"writes in place into a tensor that requires grad \(a parameter"):
        aotfuse.build(Clamp().train(), (torch.randn(5),), train=True, targets=("sm_90",))
    x = torch.randn(5, requires_grad=True)  # an input that requires grad, written in place: the same refusal
    with pytest.raises(BuildError, match=r"writes in place into a tensor that requires grad"):
        aotfuse.build(_InputScaler().train(), (x.detach().clone().requires_grad_(), x.detach()), train=True,
                      targets=("sm_90",))


def test_eval_call_of_a_train_mode_package_is_refused():
    """The packaged program normalizes with batch statistics: `.eval()` cannot switch it to the running
    ones, so an eval-mode call (which eager would answer differently) is refused, not answered wrongly."""
    _, res = _built("bn2d")
    mod = aotfuse.load(res.data, device="cpu").as_module().eval()
    with pytest.raises(AotfuseError, match=r"packaged in train mode .*\.eval\(\) cannot change it"):
        mod(*_inputs("bn2d", 3))
    mod.train()
    assert torch.isfinite(mod(*_inputs("bn2d", 3)))


def test_in_place_update_of_an_input_is_refused_in_inference_too():
    """The inference archive has no output for the caller's tensor either (it built, then failed at its first
    call: one output more than the archive's structure)."""
    with pytest.raises(BuildError, match=r"the forward writes into its input\(s\) 'offsets' in place"):
        aotfuse.build(_InputScaler().eval(), (torch.randn(5), torch.randn(5)), targets=("sm_90",))
