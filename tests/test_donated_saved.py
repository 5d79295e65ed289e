"""Buffers in the bytes of idle buffers (schedule/hosts.py, Alloc.host): a training backward's saved tensors
after their last read (schedule/donors.py, Executor.run(donate=...), runtime/training.py `_frees_saved`), and
outputs before they are written.

CPU: the plan (the arena shrinks, in-place reuse for the cross-entropy gradient and for an output written
over its producer's result), gradients and outputs against eager, that the saved tensors really are written
over when autograd frees them and never when the graph is kept (retain_graph), gradient accumulation and two
forwards alive, the runtime's refusals (shared storage), and load validation of hosted allocs. GPU: the
same under CUDA graphs, and the memory held against the same model built without hosts."""
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


def _build(donate=True, min_bytes=64 * 1024, targets=("sm_90",), hosts=True):
    torch.manual_seed(0)
    model = Net()
    with override(donate=donate, donate_min_bytes=min_bytes, output_hosts=hosts):
        res = aotfuse.build(model, _batch(0), train=True, targets=targets)
    return model, res


@pytest.fixture(scope="module")
def built():
    return _build()


def _donor_allocs(program: Program) -> list[Alloc]:
    """Allocs in a program input's bytes."""
    names = {i.buf for i in program.inputs}
    return [i for i in program.instructions if isinstance(i, Alloc) and i.host in names]


def test_the_backward_places_buffers_in_saved_tensors_and_its_arena_shrinks(built):
    _, res = built
    _, plain = _build(donate=False, hosts=False)
    mem, before = res.report.backward.memory, plain.report.backward.memory
    assert mem.donated_bytes > 0 and "saved tensors" in mem.donation, mem
    assert mem.arena_bytes < before.arena_bytes, (mem, before)
    assert before.donated_bytes == 0 and before.donation == ""
    art = aotfuse.load(res.data, device="cpu")
    bwd = art.executors["backward"].program
    assert bwd.version == DONOR_VERSION and _donor_allocs(bwd)
    # the logits' gradient is written over the saved logits in the kernel that reads them last (in place)
    assert any(a.offset == 0 and a.shape == (ROWS, VOCAB) for a in _donor_allocs(bwd))
    # without hosts the programs keep their version and bytes
    plain_art = aotfuse.load(plain.data, device="cpu")
    assert all(p.program.version < DONOR_VERSION for p in plain_art.executors.values())


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


def _forward_keeping_saved(pm, batch):
    """(loss, the tensors autograd saved, copies of their values), .grad cleared first."""
    for p in pm.parameters():
        p.grad = None
    kept, hooks = _saved_refs()
    with hooks:
        loss = pm(*batch)
    return loss, kept, [t.clone() for t in kept]


def test_gradients_match_eager_and_saved_tensors_are_spent_only_when_autograd_frees_them(built):
    model, res = built
    pm = aotfuse.load(res.data, device="cpu").as_module()
    ref = copy.deepcopy(model)
    for step in range(2):
        x, y = _batch(10 + step)
        for p in ref.parameters():
            p.grad = None
        loss, kept, before = _forward_keeping_saved(pm, (x, y))
        loss.backward()
        ref(x, y).backward()
        _close(_grads(pm), _grads(ref))
        assert any(not torch.equal(a, b) for a, b in zip(kept, before)), "nothing was donated"
    # retain_graph: the saved tensors keep their values, and a second backward gives the same gradients
    x, y = _batch(20)
    loss, kept, before = _forward_keeping_saved(pm, (x, y))
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


def _program_editor(data: bytes, name: str):
    """(the program `name` as plain data, load(program): the archive loaded with that program instead)."""
    import msgpack

    from aotfuse.archive import read_archive, write_archive

    ar = read_archive(data)
    parts = {n: ar.part(n) for n in ar.part_names}

    def load_with(p):
        new = dict(parts, **{f"program.{name}": msgpack.packb(p, use_bin_type=True)})
        return aotfuse.load(write_archive(copy.deepcopy(ar.manifest), new, dict(ar.weights)), device="cpu")

    return msgpack.unpackb(parts[f"program.{name}"], raw=False), load_with


def test_load_refuses_a_read_after_donation_and_overlaps(built):
    _, res = built
    prog, load_with = _program_editor(res.data, "backward")
    ins = prog["instructions"]
    names = {i["buf"] for i in prog["inputs"]}
    k = next(i for i, x in enumerate(ins) if x["op"] == "alloc" and x.get("host") in names)
    donor = ins[k]["host"]

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
    arena = copy.deepcopy(prog)  # a buffer of the arena hosts nothing
    j = next(i for i, x in enumerate(ins) if x["op"] == "alloc" and "host" not in x and x["offset"] >= 0)
    arena["instructions"].insert(j + 1, dict(arena["instructions"][k], host=ins[j]["buf"], buf="extra_buffer"))
    with pytest.raises(ArchiveError, match="only a program input or a buffer allocated on its own"):
        load_with(arena)
    twice = copy.deepcopy(prog)  # a second buffer over the first while both live
    a = dict(twice["instructions"][k], buf="extra_buffer")
    twice["instructions"].insert(k + 1, a)
    with pytest.raises(ArchiveError, match="overlap"):
        load_with(twice)


class Head(torch.nn.Module):
    """An MLP, then a large head with Gemma-2's soft cap: the logits' matmul result, the MLP's temporaries and
    the output are what a plan without hosts holds at once."""

    def __init__(self, d=64, vocab=3000):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 8 * d)
        self.fc2 = torch.nn.Linear(8 * d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = x + self.fc2(F.silu(self.fc1(x)))
        return torch.tanh(self.head(h) / 30.0) * 30.0


def _infer(hosts: bool, targets=("sm_90",)):
    torch.manual_seed(1)
    model = Head().eval()
    with override(output_hosts=hosts, donate_min_bytes=64 * 1024):
        return model, aotfuse.build(model, (torch.randn(ROWS, D),), targets=targets)


@pytest.fixture(scope="module")
def inferred():
    return _infer(True)


def test_an_output_hosts_what_dies_before_it_is_written(inferred):
    model, res = inferred
    _, plain = _infer(False)
    mem = res.report.memory
    assert "in 1 outputs" in mem.donation and mem.arena_bytes < plain.report.memory.arena_bytes / 4, mem
    art = aotfuse.load(res.data, device="cpu")
    prog = art.executors["forward"].program
    out = prog.returned[0].t
    hosted = [i for i in prog.instructions if isinstance(i, Alloc) and i.host == out]
    # allocated first; the capped logits are written over the matmul's result (in place, offset 0)
    assert isinstance(prog.instructions[0], Alloc) and prog.instructions[0].buf == out
    assert any(a.offset == 0 and a.shape == (ROWS, 3000) for a in hosted), hosted
    for seed in range(2):
        x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want = model(x)
        got = art(x)
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_load_refuses_a_host_written_over_a_live_buffer(inferred):
    _, res = inferred
    prog, load_with = _program_editor(res.data, "forward")
    ins = prog["instructions"]
    out = ins[0]["buf"]

    load_with(prog)
    w = next(i for i, x in enumerate(ins) if x["op"] == "launch" and out in x["args"])  # the write of the output
    k = next(i for i, x in enumerate(ins) if x["op"] == "alloc" and x.get("host") == out and i < w)
    tenant = ins[k]["buf"]
    unread = copy.deepcopy(prog)  # a buffer that lies in the output and is not read by the write: still live
    unread["instructions"].insert(w, {"op": "alloc", "buf": "late", "offset": ins[k]["offset"], "host": out,
                                      "shape": ins[k]["shape"], "dtype": ins[k]["dtype"]})
    with pytest.raises(ArchiveError):  # overlaps the live tenant, or is written over while live
        load_with(unread)
    after = copy.deepcopy(prog)  # a buffer placed in the output after it was written
    after["instructions"].insert(w + 2, {"op": "alloc", "buf": "late", "offset": 0, "host": out, "shape": [4],
                                         "dtype": "float32"})
    with pytest.raises(ArchiveError, match="no longer idle"):
        load_with(after)
    kept = copy.deepcopy(prog)  # the buffer the write read in place is not freed right after it
    nxt = kept["instructions"][w + 1]
    if nxt["op"] == "free" and tenant in nxt["bufs"]:
        nxt["bufs"].remove(tenant)
        if not nxt["bufs"]:
            kept["instructions"].pop(w + 1)
        with pytest.raises(ArchiveError, match="not freed here"):
            load_with(kept)


class _LaterReader(torch.nn.Module):
    """An output (o1, fused through y) stored before a later store's body loads the dying matmul result through
    a member that is not stored (sin(t), read by two outputs): o1 must not be written over t (review, 2026-11-28)."""

    def forward(self, x, w, y):
        t = x @ w
        a = torch.sin(t)
        return y * 3, a * y, a + y


def test_in_place_only_for_the_kernels_last_store():
    torch.manual_seed(0)
    n = 64
    with override(donate_min_bytes=4096):
        res = aotfuse.build(_LaterReader(), tuple(torch.randn(n, n) for _ in range(3)), targets=("sm_90",))
    art = aotfuse.load(res.data, device="cpu")
    prog = art.executors["forward"].program
    first = prog.returned[0].t
    assert not any(isinstance(i, Alloc) and i.host == first for i in prog.instructions)
    ins = tuple(torch.randn(n, n) for _ in range(3))
    for g, r in zip(art(*ins), _LaterReader()(*ins)):
        assert float((g.double() - r.double()).norm() / r.double().norm()) < 1e-6


def test_contract_round_trip_and_version():
    a = Alloc("b", 256, (4, 4), "float32", "in0")
    assert Alloc.from_dict(a.to_dict()) == a
    assert "host" not in Alloc("b", 0, (4,), "float32").to_dict()


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
    _, plain = _build(donate=False, targets=_arch(), hosts=False)
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
    # what the module holds between steps and the peak of its first steps are below the same model's without
    # hosts (the shared arena: the forward's and the backward's)
    (held, peak), (held0, peak0) = _held(res.data), _held(plain.data)
    assert held < held0 and peak < peak0, (held, held0, peak, peak0, res.report.backward.memory)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_an_output_hosting_buffers_matches_eager_under_graphs():
    model, res = _infer(True, _arch())
    _, plain = _infer(False, _arch())
    model = model.cuda()
    for data in (res.data, plain.data):
        art = aotfuse.load(data, device="cuda")
        for seed in range(3):
            x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(seed)).cuda()
            with torch.no_grad():
                want = model(x)
            got = art(x)
            assert float((got - want).float().norm() / want.float().norm()) < 1e-4
        del art
    assert res.report.memory.arena_bytes < plain.report.memory.arena_bytes
