"""A training backward reuses the bytes of saved tensors it has read for the last time (schedule/donors.py,
schedule/memplan.py `_donate`, Alloc.donor, Executor.run(donate=...), runtime/training.py `_frees_saved`).

CPU: the plan (the arena shrinks, in-place reuse for the cross-entropy gradient), gradients against eager
over steps, that the saved tensors really are written over when autograd frees them and never when the
graph is kept (retain_graph), gradient accumulation and two forwards alive, the runtime's refusals
(shared storage), and load validation of donated allocs. GPU: the same under CUDA graphs, and the step's
peak memory against the same model built without donation."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import aotfuse
from aotfuse.contract.program import DONOR_VERSION, Alloc, Program
from aotfuse.errors import ArchiveError
from aotfuse.knobs import override


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, d=64, n=3, vocab=3000):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(n)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x), y)


ROWS, D, VOCAB = 1024, 64, 3000


def _batch(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, D, generator=g)
    y = torch.randint(0, VOCAB, (ROWS,), generator=g)
    return x.to(device), y.to(device)


def _build(donate=True, min_bytes=64 * 1024, targets=("sm_90",)):
    torch.manual_seed(0)
    model = Net()
    with override(donate=donate, donate_min_bytes=min_bytes):
        res = aotfuse.build(model, _batch(0), train=True, targets=targets)
    return model, res


@pytest.fixture(scope="module")
def built():
    return _build()


def _donor_allocs(program: Program) -> list[Alloc]:
    return [i for i in program.instructions if isinstance(i, Alloc) and i.donor is not None]


def test_the_backward_places_buffers_in_saved_tensors_and_its_arena_shrinks(built):
    _, res = built
    _, plain = _build(donate=False)
    mem, before = res.report.backward.memory, plain.report.backward.memory
    assert mem.donated_bytes > 0 and "donatable saved tensors" in mem.donation, mem
    assert mem.arena_bytes < before.arena_bytes, (mem, before)
    assert before.donated_bytes == 0 and before.donation == ""
    art = aotfuse.load(res.data, device="cpu")
    bwd = art.executors["backward"].program
    assert bwd.version == DONOR_VERSION and _donor_allocs(bwd)
    assert art.executors["forward"].program.version < DONOR_VERSION  # nothing donated there: its bytes unchanged
    # the logits' gradient is written over the saved logits in the kernel that reads them last (in place)
    names = {i.buf for i in bwd.inputs}
    assert all(a.donor in names for a in _donor_allocs(bwd))
    assert any(a.offset == 0 and a.shape == (ROWS, VOCAB) for a in _donor_allocs(bwd))


def _saved_refs():
    """saved_tensors_hooks that keep a reference to each tensor autograd saves (the tensor itself)."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    return kept, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _grads(m):
    return [p.grad.detach().clone() for p in m.parameters()]


def _close(a, b, tol=1e-4):
    for x, y in zip(a, b):
        assert float((x - y).norm() / y.norm().clamp_min(1e-30)) <= tol


def test_gradients_match_eager_and_saved_tensors_are_spent_only_when_autograd_frees_them(built):
    model, res = built
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    for step in range(2):
        x, y = _batch(10 + step)
        for m in (pm, ref):
            for p in m.parameters():
                p.grad = None
        kept, hooks = _saved_refs()
        with hooks:
            loss = pm(x, y)
        before = [t.clone() for t in kept]
        loss.backward()
        ref(x, y).backward()
        _close(_grads(pm), _grads(ref))
        assert any(not torch.equal(a, b) for a, b in zip(kept, before)), "nothing was donated"
    # retain_graph: the saved tensors keep their values, and a second backward gives the same gradients
    x, y = _batch(20)
    for p in pm.parameters():
        p.grad = None
    kept, hooks = _saved_refs()
    with hooks:
        loss = pm(x, y)
    before = [t.clone() for t in kept]
    loss.backward(retain_graph=True)
    first = _grads(pm)
    assert all(torch.equal(a, b) for a, b in zip(kept, before))
    for p in pm.parameters():
        p.grad = None
    loss.backward()
    _close(_grads(pm), first, 0)
    for p in ref.parameters():
        p.grad = None
    ref(x, y).backward()
    _close(first, _grads(ref))


def test_accumulation_and_two_forwards_alive(built):
    model, res = built
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    b1, b2 = _batch(30), _batch(31)
    for m in (pm, ref):
        (m(*b1) + 0.5 * m(*b2)).backward()  # two forwards' saved tensors alive, then one backward each
        m(*_batch(32)).backward()  # accumulated into .grad
    _close(_grads(pm), _grads(ref))


def test_a_saved_tensor_sharing_storage_is_not_written_over(built):
    _, res = built
    art = aotfuse.load(res.data, device="cpu")
    ex = art.executors["backward"]
    donors = sorted(ex.donor_need)
    assert donors
    env = [None] * ex.n_slots
    inputs = {s: torch.zeros(ex.donor_need.get(s, 4) // 4 + 1) for s in ex.input_slots}
    for s, t in inputs.items():
        env[s] = t
    assert ex._donatable(env) == set(donors)
    a, b = donors[0], next(s for s in ex.input_slots if s != donors[0])
    env[b] = env[a][:1]  # another input views the same storage: that donor keeps its values
    assert a not in ex._donatable(env)
    env[b] = inputs[b]
    env[a] = torch.zeros(2 * ex.donor_need[a] // 4 + 2)[::2]  # not row-major
    assert a not in ex._donatable(env)
    env[a] = torch.zeros(1)  # too small
    assert a not in ex._donatable(env)


def test_load_refuses_a_read_after_donation_and_overlaps(built):
    import msgpack

    from aotfuse.archive import read_archive, write_archive

    _, res = built
    ar = read_archive(res.data)
    parts = {n: ar.part(n) for n in ar.part_names}
    prog = msgpack.unpackb(parts["program.backward"], raw=False)
    ins = prog["instructions"]
    k = next(i for i, x in enumerate(ins) if x["op"] == "alloc" and "donor" in x)
    donor = ins[k]["donor"]

    def load_with(p):
        new = dict(parts, **{"program.backward": msgpack.packb(p, use_bin_type=True)})
        return aotfuse.load(write_archive(copy.deepcopy(ar.manifest), new, dict(ar.weights)), device="cpu")

    load_with(prog)  # as built: valid
    late = copy.deepcopy(prog)  # the donor used after the launch that followed its donation
    late["instructions"].insert(len(ins) - 1, {"op": "free", "bufs": [donor]})
    with pytest.raises(ArchiveError, match="donated"):
        load_with(late)
    old = copy.deepcopy(prog)
    old["version"] = DONOR_VERSION - 1
    with pytest.raises(ArchiveError, match="version"):
        load_with(old)
    outside = copy.deepcopy(prog)
    outside["instructions"][k]["offset"] = 1 << 40
    with pytest.raises(ArchiveError):
        load_with(outside)
    own = copy.deepcopy(prog)  # only a program input's bytes may be donated
    own["instructions"].insert(k, {"op": "alloc", "buf": "own", "offset": -1, "shape": [1 << 20], "dtype": "float32"})
    own["instructions"][k + 1]["donor"] = "own"
    with pytest.raises(ArchiveError, match="only a program input"):
        load_with(own)
    twice = copy.deepcopy(prog)  # a second buffer over the first while both live
    a = dict(twice["instructions"][k], buf="extra_buffer")
    twice["instructions"].insert(k + 1, a)
    with pytest.raises(ArchiveError, match="overlap"):
        load_with(twice)


def test_contract_round_trip_and_version():
    a = Alloc("b", 256, (4, 4), "float32", "in0")
    assert Alloc.from_dict(a.to_dict()) == a
    assert "donor" not in Alloc("b", 0, (4,), "float32").to_dict()


# ---------------------------------------------------------------- GPU

def _arch():
    major, minor = torch.cuda.get_device_capability()
    return (f"sm_{major}{minor}",)


def _held(data: bytes) -> int:
    """Bytes a loaded train module holds after a few steps with graphs (weights, arena, output sets), and
    the peak of those steps, above what was allocated before the load."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pm = aotfuse.load(data, device="cuda").as_module()
    for s in range(4):
        for p in pm.parameters():
            p.grad = None
        pm(*_batch(60 + s, "cuda")).backward()
    torch.cuda.synchronize()
    held, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    del pm
    return held, peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_donate_match_eager_and_lower_the_peak():
    model, res = _build(targets=_arch())
    _, plain = _build(donate=False, targets=_arch())
    pm = aotfuse.load(res.data, device="cuda").as_module()
    ref = copy.deepcopy(model).cuda()
    for step in range(4):
        batch = _batch(40 + step, "cuda")
        for m in (pm, ref):
            for p in m.parameters():
                p.grad = None
            m(*batch).backward()
        _close(_grads(pm), _grads(ref), 2e-3)
    bwd = pm._graphs["backward"]
    st = bwd.stats
    assert st["warmups"] == 1 and st["captures"] == 1 and st["replays"] == 3 and st["eager_calls"] == 0, st
    # retain_graph: a graph of its own that keeps the saved tensors; both backwards give eager's gradients
    batch = _batch(50, "cuda")
    for m in (pm, ref):
        for p in m.parameters():
            p.grad = None
    loss = pm(*batch)
    loss.backward(retain_graph=True)
    first = _grads(pm)
    for p in pm.parameters():
        p.grad = None
    loss.backward()
    ref(*batch).backward()
    _close(first, _grads(ref), 2e-3)
    _close(_grads(pm), _grads(ref), 2e-3)
    # what the module holds between steps (the shared arena is the backward's) and the peak of its first
    # steps are below the same model's without donation
    (held, peak), (held0, peak0) = _held(res.data), _held(plain.data)
    assert held < held0 and peak < peak0, (held, held0, peak, peak0, res.report.backward.memory)
