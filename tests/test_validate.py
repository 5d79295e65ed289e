"""Programs validated at load (issue 6, point 4): a wrong program is an ArchiveError at load, never
a KeyError/TypeError/hang mid-run, and a weight that disagrees with its program is refused.

Small real archives are built once (an inference GPT with attention, a train GPT with dropout, and
the committed v1 golden model); each is decoded, one thing in it is made wrong, and it is written
back with write_archive (every checksum recomputed), then loaded on the CPU without running.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

import aotfuse
from aotfuse.contract import MAX_SUPPORTED_VERSION
from aotfuse.archive import read_archive, write_archive
from aotfuse.errors import ArchiveError
from aotfuse.runtime.validate import validate_program
from aotfuse.knobs import knobs

GOLDEN = Path(__file__).resolve().parents[1] / "artifacts" / "golden" / "v1_model.aotf"
DTYPE_NAMES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]


# ---------------------------------------------------------------- base archives

def _fake_compile(kernels, targets, workers, progress=None):
    """The CPU path never reads cubins: skip Triton's compiler, keep the build's real metadata."""
    from aotfuse.emit.compile import Binary

    return {k.name: {"sm_90": Binary("sm_90", b"not-a-cubin", k.name, k.num_warps, 0, 0, 0)} for k in kernels}


def _build(train: bool, step: str = "split", stages: int = 1) -> bytes:
    from aotfuse.examples.gpt import GPT, GPTConfig, GPTWithLoss, _init

    cfg = GPTConfig(vocab=32, seq=4, dim=16, heads=2, layers=1, dropout=0.1 if train else 0.0)
    model = _init((GPTWithLoss if train else GPT)(cfg), seed=0)
    ids = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(0))
    kw = {"step": step, "backward_stages": stages} if train else {}
    return aotfuse.build(model.train(train), (ids, ids) if train else (ids,), train=train, targets=("sm_90",),
                         **kw).data


@dataclasses.dataclass
class Decoded:
    """An archive as data: msgpack parts decoded, the rest kept as bytes."""

    manifest: dict
    parts: dict  # name -> decoded value (program.*, kernels) or bytes
    weights: dict

    def encode(self) -> bytes:
        parts = {n: v if isinstance(v, bytes) and not n.startswith(("program.", "kernels"))
                 else msgpack.packb(v, use_bin_type=True) for n, v in self.parts.items()}
        return write_archive(self.manifest, parts, self.weights)

    def copy(self) -> "Decoded":
        return Decoded(copy.deepcopy(self.manifest), copy.deepcopy(self.parts), dict(self.weights))

    @property
    def version(self) -> int:
        return self.parts["program." + self.manifest["programs"][0]]["version"]


def decode(data: bytes) -> Decoded:
    ar = read_archive(data)
    parts = {}
    for n in ar.part_names:
        raw = ar.part(n)
        parts[n] = msgpack.unpackb(raw, raw=False) if n.startswith("program.") or n == "kernels" else raw
    return Decoded(ar.manifest, parts, {k: v.clone() for k, v in ar.weights.items()})


@pytest.fixture(scope="module")
def bases(monkeypatch_module):
    monkeypatch_module.setattr("aotfuse.pipeline.compile_all", _fake_compile)
    monkeypatch_module.setattr("aotfuse.knobs.knobs.mm", "extern")  # the extern cases need cuBLAS calls
    return {"gpt": decode(_build(False)), "train": decode(_build(True)), "step": decode(_build(True, "step")),
            "staged": decode(_build(True, "split", 2)), "golden_v1": decode(GOLDEN.read_bytes())}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_unmutated_archives_load_and_run(bases):
    for name, d in bases.items():
        art = aotfuse.load(d.encode(), device="cpu")
        assert art.kernels and art.programs, name
    # 4, or 7 (PDL_VERSION) with knobs.pdl (emit/pdl.py)
    assert bases["gpt"].version == (7 if knobs.pdl else 4) and bases["golden_v1"].version == 1
    ids = torch.randint(0, 32, (2, 4))
    aotfuse.load(bases["gpt"].encode(), device="cpu")(ids)  # the re-encoded archive still runs


# ---------------------------------------------------------------- program analysis helpers

def _views(a):
    if isinstance(a, dict) and "t" in a:
        yield a
    elif isinstance(a, list):
        for x in a:
            yield from _views(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _views(x)


def uses(ins: dict) -> list[str]:
    op = ins["op"]
    if op == "launch":
        return list(ins["args"])
    if op == "extern":
        got = [v["t"] for v in _views([ins["args"], ins["kwargs"]])]
        return got + ([ins["out"]] if ins["out_variant"] else [])
    if op == "return":
        return [v["t"] for v in ins["outputs"]]
    return []


def defines(ins: dict) -> str | None:
    if ins["op"] == "alloc" or (ins["op"] == "extern" and not ins["out_variant"]):
        return ins.get("buf", ins.get("out"))
    return None


def numels(prog: dict, weights: dict) -> dict[str, int]:
    out = {s["buf"]: _prod(s["shape"]) for s in prog["inputs"]}
    out.update({b: weights[f].numel() for b, f in prog["weights"].items()})
    for ins in prog["instructions"]:
        if ins["op"] == "alloc" or (ins["op"] == "extern" and not ins["out_variant"]):
            out[defines(ins)] = _prod(ins["shape"])
        if ins["op"] == "extern":  # a multi-result op's further results
            out.update((o["out"], _prod(o["shape"])) for o in ins.get("outs", []))
    return out


def _prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


EVIL = [None, -1, 2**31, 2**50, 2**64 - 1, -(2**63), 1.5, "x", True, [], {}, [[[[[[1]]]]]], {"t": "nope"},
        b"\x00", [None], {"op": "alloc"}]


# ---------------------------------------------------------------- targeted mutations (all must be refused)
# Each takes (archive, rng), changes one thing that makes the archive wrong by construction, and says
# what it did; None when it does not apply to this archive.

def _prog(d, rng):
    name = rng.choice(d.manifest["programs"])
    return name, d.parts[f"program.{name}"]


def _pick(prog, rng, *ops):
    idx = [i for i, ins in enumerate(prog["instructions"]) if ins["op"] in ops]
    return rng.choice(idx) if idx else None


def m_alloc_outside_arena(d, rng):
    name, p = _prog(d, rng)
    idx = [i for i, ins in enumerate(p["instructions"]) if ins["op"] == "alloc" and ins["offset"] >= 0]
    if not idx:
        return None
    ins = p["instructions"][rng.choice(idx)]
    ins["offset"] = p["arena_bytes"] + 16 * rng.randint(0, 64)
    return f"{name}: alloc {ins['buf']} at {ins['offset']} (arena {p['arena_bytes']})"


def m_alloc_offset(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "alloc")
    ins = p["instructions"][i]
    if ins["offset"] >= 0 and rng.random() < 0.5:
        ins["offset"] += rng.randint(1, 15)  # misaligned
    else:
        ins["offset"] = rng.choice([-2, -(2**40), 2**50, "0", None, 1.0, True, [0]])
    return f"{name}: alloc offset {ins['offset']!r}"


def m_alloc_shape(d, rng):
    name, p = _prog(d, rng)
    ins = p["instructions"][_pick(p, rng, "alloc")]
    choice = rng.randrange(4)
    if choice == 0 and ins["shape"]:
        ins["shape"][rng.randrange(len(ins["shape"]))] = rng.choice([-1, "4", None, 1.5, [], 2**41])
    elif choice == 1:
        ins["shape"] = [1] * 40
    elif choice == 2:
        ins["shape"] = [2**21] * 3
    else:
        ins["shape"] = rng.choice([None, "2,3", 6, {"0": 2}])
    return f"{name}: alloc shape {ins['shape']!r}"


def m_alloc_dtype(d, rng):
    name, p = _prog(d, rng)
    ins = p["instructions"][_pick(p, rng, "alloc")]
    # another valid dtype: the buffer's writer (a launch or an out= extern) then disagrees with it
    ins["dtype"] = rng.choice([x for x in DTYPE_NAMES if x != ins["dtype"]] + ["float128", 7, None])
    return f"{name}: alloc {ins['buf']} dtype {ins['dtype']!r}"


def m_alloc_structure(d, rng):
    name, p = _prog(d, rng)
    instrs = p["instructions"]
    i = _pick(p, rng, "alloc")
    kind = rng.randrange(4)
    if kind == 0:
        instrs[i]["buf"] = instrs[i]["buf"] + "_renamed"
    elif kind == 1:
        instrs.insert(i + 1, copy.deepcopy(instrs[i]))
    elif kind == 2:
        del instrs[i]
    else:  # move it after the first instruction that uses the buffer
        buf = instrs[i]["buf"]
        j = next(j for j in range(i + 1, len(instrs)) if buf in uses(instrs[j]))
        instrs.insert(j, instrs.pop(i))
    return f"{name}: alloc structure change {kind} at {i}"


def m_launch_args(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "launch")
    if i is None:
        return None
    args = p["instructions"][i]["args"]
    kind = rng.randrange(4)
    if kind == 0:
        del args[rng.randrange(len(args))]
    elif kind == 1:
        args.insert(rng.randrange(len(args) + 1), rng.choice(args))
    elif kind == 2:
        args[rng.randrange(len(args))] = rng.choice(["nope", "buf7", None, 3, ["x"]])
    else:
        p["instructions"][i]["args"] = rng.choice([None, "in0", {}, []])
    return f"{name}: launch {i} args change {kind}"


def m_launch_grid(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "launch")
    if i is None:
        return None
    g = p["instructions"][i]["grid"][0]
    p["instructions"][i]["grid"] = rng.choice([[2**31, 1, 1], [0, 1, 1], [-1, 1, 1], [g + 1, 1, 1], [g, 2, 1],
                                               [g, 1, 65536], [g], [g, 1, 1, 1], "6", None, [g * 1024, 1, 1],
                                               [g, 1.0, 1], [2**31 - 1, 1, 1], [g, True, 1]])
    return f"{name}: launch {i} grid {p['instructions'][i]['grid']!r}"


def m_launch_kernel(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "launch")
    if i is None:
        return None
    p["instructions"][i]["kernel"] = rng.choice(["aotf_pw_000000000000", None, 5, ["k"], ""])
    return f"{name}: launch {i} unknown kernel"


def m_extern_target(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "extern")
    if i is None:
        return None
    ins = p["instructions"][i]
    kind = rng.randrange(3)
    if kind == 0:
        ins["target"] = rng.choice(["aten.mm.default", "os.system", "builtins.eval", "torch.ops.aten.mm.out",
                                    None, 3, "aten.add.out"])
    elif kind == 1:
        ins["out_variant"] = rng.choice([not ins["out_variant"], None, 1, "true"])
    else:
        ins["kwargs"]["out"] = copy.deepcopy(ins["out_view"])
    return f"{name}: extern {i} target/variant change {kind}"


def m_extern_args(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "extern")
    if i is None:
        return None
    ins = p["instructions"][i]
    kind = rng.randrange(5)
    if kind == 0:
        del ins["args"][0]  # the first argument is always a required tensor
    elif kind == 1:
        ins["args"][0] = rng.choice([3, 1.5, "x", None, [1, 2], {"x": 1}, [[[[[[1]]]]]], b"\x00", True])
    elif kind == 2:
        ins["args"] = rng.choice([None, {}, "args", 5])
    elif kind == 3:
        ins["args"].append([[[[[1]]]]])
    else:
        ins["kwargs"] = rng.choice([None, [], {"1": 1, 2: 3}, {"no such kw": 1}])
    return f"{name}: extern {i} args change {kind}"


def _all_views(p):
    out = []
    for i, ins in enumerate(p["instructions"]):
        if ins["op"] == "extern":
            out += [(i, v) for v in _views([ins["args"], ins["kwargs"]])] + [(i, ins["out_view"])]
        elif ins["op"] == "return":
            out += [(i, v) for v in ins["outputs"]]
    return out


def m_view_out_of_bounds(d, rng):
    name, p = _prog(d, rng)
    views = [(i, v) for i, v in _all_views(p) if _prod(v["shape"])]
    i, v = rng.choice(views)
    n = numels(p, d.weights)[v["t"]]
    kind = rng.randrange(6)
    if kind == 0:
        v["offset"] = n
    elif kind == 1:
        v["offset"] = rng.choice([-1, 2**62, "0", None, 0.5])
    elif kind == 2:
        v["shape"] = [n + 1]
        v["stride"] = [1]
    elif kind == 3:
        v["stride"] = [s + n for s in v["stride"]] if any(dim > 1 for dim in v["shape"]) else [-1] * len(v["shape"])
        if not any(dim > 1 for dim in v["shape"]):
            v["offset"] = n
    elif kind == 4:
        v["stride"] = v["stride"][:-1] + [None] if v["stride"] else [1]
    else:
        v["t"] = rng.choice(["nope", None, 3])
    return f"{name}: view in instruction {i} change {kind}"


def m_extern_out(d, rng):
    name, p = _prog(d, rng)
    i = _pick(p, rng, "extern")
    if i is None:
        return None
    ins = p["instructions"][i]
    if rng.random() < 0.5:
        ins["out"] = ins["out"] + "_x"
    else:
        ins["shape"] = [0] + ins["shape"][1:]  # smaller than its output view (or than its alloc)
    return f"{name}: extern {i} out change"


def m_free(d, rng):
    name, p = _prog(d, rng)
    instrs = p["instructions"]
    kind = rng.randrange(4)
    if kind == 0:
        instrs.insert(rng.randrange(len(instrs)), {"op": "free", "bufs": [rng.choice(["nope", None, 7])]})
    elif kind == 1:
        i = _pick(p, rng, "free")
        if i is None:
            return None
        instrs.insert(i + 1, copy.deepcopy(instrs[i]))  # double free
    elif kind == 2:  # use after free: free a buffer just before an instruction that uses it
        cands = [(j, b) for j, ins in enumerate(instrs) for b in uses(ins) if isinstance(b, str)]
        j, b = rng.choice(cands)
        instrs.insert(j, {"op": "free", "bufs": [b]})
    else:
        i = _pick(p, rng, "free")
        if i is None:
            return None
        instrs[i]["bufs"] = rng.choice([[], None, "ext1", [["x"]]])
    return f"{name}: free change {kind}"


def m_return(d, rng):
    name, p = _prog(d, rng)
    instrs = p["instructions"]
    ret = instrs[-1]
    kind = rng.randrange(5)
    if kind == 0:
        del instrs[-1]
    elif kind == 1:
        instrs.append(copy.deepcopy(ret))
    elif kind == 2:
        instrs.insert(rng.randrange(len(instrs) - 1), copy.deepcopy(ret))
    elif kind == 3:
        del ret["outputs"][rng.randrange(len(ret["outputs"]))]
    else:
        ret["outputs"] = rng.choice([None, {}, "out", [1]])
    return f"{name}: return change {kind}"


def m_reorder(d, rng):
    """Move an instruction that uses a buffer before the instruction that defines it."""
    name, p = _prog(d, rng)
    instrs = p["instructions"]
    where = {defines(ins): i for i, ins in enumerate(instrs) if defines(ins)}
    cands = [(j, where[b]) for j, ins in enumerate(instrs) for b in uses(ins) if b in where and where[b] < j]
    j, i = rng.choice(cands)
    instrs.insert(i, instrs.pop(j))
    return f"{name}: instruction {j} moved before {i}"


def m_unknown_instruction(d, rng):
    name, p = _prog(d, rng)
    bad = rng.choice([{"op": "exec", "code": "import os"}, {"op": None}, "alloc", 42, [], None, {"bufs": []},
                      {"op": "launch"}, {"op": "extern", "target": "aten.mm.out"}, {"op": "alloc", "buf": "z"}])
    p["instructions"].insert(rng.randrange(len(p["instructions"])), bad)
    return f"{name}: inserted {bad!r}"


def m_program_fields(d, rng):
    name, p = _prog(d, rng)
    kind = rng.randrange(9)
    used = {b for ins in p["instructions"] for b in uses(ins)}
    if kind == 0:
        p["arena_bytes"] = rng.choice([2**50, -1, "1024", None, 1.0, p["arena_bytes"] + 256])
    elif kind == 1:
        ends = [ins["offset"] for ins in p["instructions"] if ins["op"] == "alloc" and ins["offset"] >= 0]
        if not ends:
            return None
        p["arena_bytes"] = max(ends)  # smaller than the allocation that reaches furthest
    elif kind == 2:
        p["version"] = rng.choice([0, MAX_SUPPORTED_VERSION + 1, "2", None, True, 2.0])
    elif kind == 3:
        if not p["inputs"]:
            return None
        spec = rng.choice(p["inputs"])
        field = rng.choice(["shape", "dtype", "buf"])
        if field == "buf" and spec["buf"] not in used:
            return None
        spec[field] = {"shape": [7] + spec["shape"], "buf": spec["buf"] + "_x",
                       "dtype": rng.choice([x for x in DTYPE_NAMES if x != spec["dtype"]])}[field]
    elif kind == 4:
        if not p["inputs"]:
            return None
        del p["inputs"][rng.randrange(len(p["inputs"]))]
    elif kind == 5:
        if not p["weights"]:
            return None
        p["weights"][rng.choice(sorted(p["weights"]))] = rng.choice(["nope.weight", None, 3])
    elif kind == 6:
        p.pop(rng.choice(["version", "inputs", "weights", "arena_bytes", "instructions"]))
    elif kind == 7:
        bufs = [s["buf"] for s in p["inputs"]] + sorted(p["weights"])
        p["rng"] = rng.choice(bufs + [5, ""]) if bufs else 5
    else:
        d.parts[f"program.{name}"] = rng.choice([[], None, "program", 1])
    return f"{name}: program field change {kind}"


def m_weight_specs(d, rng):
    if d.version < 2:
        return None
    name, p = _prog(d, rng)
    if not p["weights"]:
        return None
    buf = rng.choice(sorted(p["weights"]))
    spec = p["weight_specs"][buf]
    kind = rng.randrange(4)
    if kind == 0:
        spec["shape"] = spec["shape"] + [1] if rng.random() < 0.5 else [_prod(spec["shape"]) + 1]
    elif kind == 1:
        spec["dtype"] = rng.choice([x for x in DTYPE_NAMES if x != spec["dtype"]])
    elif kind == 2:
        del p["weight_specs"][buf]
    else:
        del p["weight_specs"]
    return f"{name}: weight spec of {buf} change {kind}"


def m_weight_rebind(d, rng):
    """A program's weight buffer bound to another weight of another dtype or shape."""
    if d.version < 2:
        return None
    name, p = _prog(d, rng)
    if not p["weights"]:
        return None
    buf = rng.choice(sorted(p["weights"]))
    t = d.weights[p["weights"][buf]]
    others = [f for f, w in d.weights.items() if (w.dtype, w.shape) != (t.dtype, t.shape)]
    p["weights"][buf] = rng.choice(others)
    return f"{name}: {buf} bound to {p['weights'][buf]}"


def _used_weights(d):
    return sorted({f for n in d.manifest["programs"] for f in d.parts[f"program.{n}"]["weights"].values()}
                  | set((d.manifest.get("train") or {}).get("params", [])))


def m_weight_dtype(d, rng):
    fqn = rng.choice(_used_weights(d))
    t = d.weights[fqn]
    other = rng.choice([x for x in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.bool,
                                    torch.complex64, torch.int64) if x != t.dtype])
    d.weights[fqn] = t.to(other)
    return f"weight {fqn} as {other}"


def m_weight_shape(d, rng):
    if d.version < 2:
        return None  # v1 programs record no weight shapes: a kernel's read extent is unknown
    fqn = rng.choice(_used_weights(d))
    t = d.weights[fqn]
    kind = rng.randrange(3)
    if kind == 0 and t.dim() != 1:
        d.weights[fqn] = t.reshape(-1)
    elif kind == 1:
        d.weights[fqn] = torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else torch.zeros(1, dtype=t.dtype)
    else:
        d.weights[fqn] = t.reshape(-1)[: max(0, t.numel() - 1)]
    return f"weight {fqn} reshaped to {list(d.weights[fqn].shape)}"


def m_weight_missing(d, rng):
    fqn = rng.choice(_used_weights(d))
    if rng.random() < 0.5:
        del d.weights[fqn]
    else:
        d.weights[fqn + "_renamed"] = d.weights.pop(fqn)
    return f"weight {fqn} missing"


def m_weight_swap(d, rng):
    names = _used_weights(d)
    pairs = [(a, b) for a in names for b in names if a < b and
             (d.weights[a].dtype != d.weights[b].dtype if d.version < 2 else
              (d.weights[a].dtype, d.weights[a].shape) != (d.weights[b].dtype, d.weights[b].shape))]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    d.weights[a], d.weights[b] = d.weights[b], d.weights[a]
    return f"weights {a} and {b} swapped"


def m_kernel(d, rng):
    kernels = d.parts["kernels"]
    name = rng.choice(sorted(kernels))
    k = kernels[name]
    v2 = "xnumel" in k
    kind = rng.randrange(14)
    if kind == 0:
        del k["args"][rng.randrange(len(k["args"]))]
    elif kind == 1:
        a = rng.choice(k["args"])
        a["dtype"] = rng.choice([x for x in DTYPE_NAMES if x != a["dtype"]] + ["float128", None])
    elif kind == 2 and v2:
        a = rng.choice(k["args"])
        a["numel"] = rng.choice([a["numel"] + 1, -1, "8", None, 2**31, 2**62])
    elif kind == 3:
        g = k["grid"][0]
        k["grid"] = rng.choice([[2**31, 1, 1], [0, 1, 1], [g + 1, 1, 1], [g, 2, 1], [g, 1, 65536], None, [g]])
    elif kind == 4:
        k[rng.choice(["xblock", "rblock"])] = rng.choice([3, 0, 2**20, -4, "8", None])
    elif kind == 5 and v2:
        k["xnumel"] += k["xblock"]
    elif kind == 6 and v2:
        k[rng.choice(["xnumel", "rnumel"])] = rng.choice([0, -1, 2**31, "4", None])
    elif kind == 7:
        k[rng.choice(["kind", "num_warps"])] = rng.choice(["exec", 3, None, 64])
    elif kind == 8:
        b = k["binaries"][rng.choice(sorted(k["binaries"]))]
        field = rng.choice(["cubin", "shared", "num_warps", "name"])
        b[field] = rng.choice({"cubin": ["str", b"", None], "shared": [-1, 2**40, "0"], "num_warps": [3, 0, 64, True],
                               "name": [None, 3, ""]}[field])
    elif kind == 9:
        k["binaries"]["sm_9x"] = k["binaries"].pop(rng.choice(sorted(k["binaries"])))
    elif kind == 10:
        kernels[name + "_renamed"] = kernels.pop(name)
    elif kind == 11:
        kernels[name] = rng.choice([None, [], "k", 1])
    elif kind == 12 and v2:
        del rng.choice(k["args"])["numel"]
    elif kind == 13:
        k.pop(rng.choice(["kind", "grid", "num_warps", "xblock", "rblock", "args", "binaries"]))
    else:
        d.parts["kernels"] = rng.choice([[], None, "kernels"])
    return f"kernel {name} change {kind}"


def m_manifest(d, rng):
    m = d.manifest
    kind = rng.randrange(10)
    if kind == 0 and m["inputs"]:
        s = rng.choice(m["inputs"])
        s["shape"] = [3] + s["shape"]
    elif kind == 1 and m["inputs"]:
        s = rng.choice(m["inputs"])
        s["dtype"] = rng.choice(["torch.float32", "torch.int32", "float32", None, "torch.complex64"])
    elif kind == 2:
        if m["inputs"]:
            del m["inputs"][rng.randrange(len(m["inputs"]))]
        else:
            m.pop("inputs")
    elif kind == 3:
        s = rng.choice(m["outputs"])
        s[rng.choice(["shape", "dtype"])] = rng.choice([[5], "torch.float16", None, 3])
    elif kind == 4:
        del m["outputs"][rng.randrange(len(m["outputs"]))]
    elif kind == 5:
        m["programs"] = rng.choice([[], ["backward"], m["programs"] + ["extra"], "forward", None,
                                    m["programs"][:1] if m.get("train") else ["forward", "backward"]])
    elif kind == 6:
        m[rng.choice(["format", "single_output"])] = rng.choice(["other", "yes", None, 1])
    elif kind == 7:
        m[rng.choice(["inputs", "outputs", "programs"])] = rng.choice([None, {}, "x", 3, [None]])
    elif kind == 8 and m.get("train"):
        t = m["train"]
        sub = rng.randrange(5)
        if sub == 0:
            del t["params"][rng.randrange(len(t["params"]))]
        elif sub == 1:
            t["grads"][rng.randrange(len(t["grads"]))] = rng.choice([["param", "nope"], ["bias", 0], ["input", 99],
                                                                      ["input", -1], "g", None])
        elif sub == 2:
            t["n_saved"] = rng.choice([t["n_saved"] + 1, t["n_saved"] - 1, -1, None, "3"])
        elif sub == 3:
            del t["grads"][rng.randrange(len(t["grads"]))]
        else:
            t[rng.choice(["params", "grads", "n_saved"])] = rng.choice([None, {}, "x"])
    elif kind == 9:
        m.pop(rng.choice(["format", "programs", "inputs", "outputs"]))
    else:
        return None
    return f"manifest change {kind}"


TARGETED = [m_alloc_outside_arena, m_alloc_offset, m_alloc_shape, m_alloc_dtype, m_alloc_structure, m_launch_args,
            m_launch_grid, m_launch_kernel, m_extern_target, m_extern_args, m_view_out_of_bounds, m_extern_out, m_free,
            m_return, m_reorder, m_unknown_instruction, m_program_fields, m_weight_specs, m_weight_rebind,
            m_weight_dtype, m_weight_shape, m_weight_missing, m_weight_swap, m_kernel, m_manifest]


# ---------------------------------------------------------------- chaos: any value anywhere

def _paths(v, path=()):
    yield path
    if isinstance(v, dict):
        for k in v:
            yield from _paths(v[k], path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, path + (i,))


def m_chaos(d, rng):
    """Replace, drop or perturb one random node of a program, the kernels part or the manifest.
    May be a harmless change (a kernel's node list, a binary's bytes): such an archive may load."""
    part = rng.choice([f"program.{n}" for n in d.manifest["programs"]] + ["kernels", "manifest"])
    root = d.manifest if part == "manifest" else d.parts[part]
    paths = [p for p in _paths(root) if p and not (part == "kernels" and "cubin" in p)]
    path = rng.choice(paths)
    parent = root
    for k in path[:-1]:
        parent = parent[k]
    old, key = parent[path[-1]], path[-1]
    r = rng.random()
    if r < 0.2 and isinstance(parent, dict):
        del parent[key]
    elif r < 0.4 and isinstance(old, int) and not isinstance(old, bool):
        parent[key] = rng.choice([old + 1, old - 1, old * 2, -old, old + 2**31, old * 2**30])
    elif r < 0.5 and isinstance(old, str):
        parent[key] = old + rng.choice(["_", "0", ".out"])
    else:
        parent[key] = copy.deepcopy(rng.choice(EVIL))
    return f"{part} at {path!r}"


# ---------------------------------------------------------------- the property test

def _load_outcome(data: bytes) -> str:
    try:
        aotfuse.inspect_archive(data)  # `aotfuse inspect` makes the same checks: ArchiveError or a summary
    except ArchiveError:
        pass
    try:
        aotfuse.load(data, device="cpu")
    except ArchiveError:
        return "refused"
    return "loaded"


def test_mutated_archives_are_refused_at_load_with_archive_error_only(bases):
    rng = random.Random(20261123)
    names = sorted(bases)
    refused, loaded, escaped, chaos_loaded = 0, [], [], 0
    t0 = time.perf_counter()
    n_targeted = n_chaos = 0
    while n_targeted < 1200 or n_chaos < 300:
        base = bases[rng.choice(names)]
        chaos = n_targeted >= 1200
        mut = m_chaos if chaos else rng.choice(TARGETED)
        d = base.copy()
        desc = mut(d, rng)
        if desc is None:
            continue
        try:
            data = d.encode()
        except ArchiveError:  # the writer itself refused (e.g. a weight dtype outside the format)
            continue
        try:
            outcome = _load_outcome(data)
        except Exception as exc:  # anything but ArchiveError is the bug this test is for
            escaped.append(f"{mut.__name__}: {desc}: {type(exc).__name__}: {exc}")
            outcome = "escaped"
        if chaos:
            n_chaos += 1
            chaos_loaded += outcome == "loaded"
        else:
            n_targeted += 1
            refused += outcome == "refused"
            if outcome == "loaded":
                loaded.append(f"{mut.__name__}: {desc}")
    seconds = time.perf_counter() - t0
    print(f"\n{n_targeted} wrong archives: {refused} ArchiveError; {n_chaos} chaos archives: "
          f"{n_chaos - chaos_loaded - sum('m_chaos' in e for e in escaped)} ArchiveError, {chaos_loaded} loaded; "
          f"{len(escaped)} other exceptions; {seconds:.1f} s")
    assert not escaped, "\n".join(escaped[:20])
    assert not loaded, "wrong archives that loaded:\n" + "\n".join(loaded[:20])
    assert refused >= 1000


# ---------------------------------------------------------------- the issue's examples, one by one

def _refused(d: Decoded, match: str) -> ArchiveError:
    with pytest.raises(ArchiveError, match=match) as info:
        aotfuse.load(d.encode(), device="cpu")
    return info.value


def _first(p, op, pred=lambda ins: True):
    return next(i for i, ins in enumerate(p["instructions"]) if ins["op"] == op and pred(ins))


def test_alloc_outside_the_arena(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "alloc", lambda ins: ins["offset"] >= 0)
    p["instructions"][i]["offset"] = p["arena_bytes"]
    _refused(d, rf"program 'forward', instruction {i} \(alloc \w+\): bytes \d+\.\.\d+ lie outside the arena")


def test_launch_with_a_missing_argument(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    p["instructions"][i]["args"].pop()
    _refused(d, rf"instruction {i} \(launch aotf_\w+\): passes \d+ arguments, the kernel takes \d+")


def test_launch_of_an_unknown_buffer(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    p["instructions"][i]["args"][0] = "buf7"
    _refused(d, rf"instruction {i} \(launch \w+\): argument 0 'buf7': buffer 'buf7' is not defined")


def test_launch_on_a_buffer_smaller_than_the_kernel_reads(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    kernel = d.parts["kernels"][p["instructions"][i]["kernel"]]
    kernel["args"][0]["numel"] += 1
    _refused(d, rf"instruction {i} \(launch \w+\): argument 0 '\w+' has \d+ elements, the kernel reads \d+")


def test_grid_of_2_31_blocks(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    p["instructions"][i]["grid"] = [2**31, 1, 1]
    _refused(d, rf"instruction {i} \(launch \w+\): grid x: 2147483648 is outside 1..2147483647")
    # a kernel table and program that agree on a giant grid: refused by the kernel's own sizes
    d = bases["golden_v1"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    d.parts["kernels"][p["instructions"][i]["kernel"]]["grid"] = [2**20, 1, 1]
    p["instructions"][i]["grid"] = [2**20, 1, 1]
    _refused(d, r"grid \[1048576, 1, 1\] is larger than its outputs \(\d+ elements\) imply")


def test_output_view_outside_its_buffer(bases):
    d = bases["gpt"].copy()
    ret = d.parts["program.forward"]["instructions"][-1]
    ret["outputs"][0]["offset"] = 1
    _refused(d, r"instruction \d+ \(return\): output 0: view of '\w+' reaches element \d+, the buffer has \d+")


def test_arena_of_one_pebibyte(bases):
    d = bases["gpt"].copy()
    d.parts["program.forward"]["arena_bytes"] = 2**50
    _refused(d, r"program 'forward': arena_bytes: 1125899906842624 is outside 0..1099511627776")
    d = bases["gpt"].copy()
    d.parts["program.forward"]["arena_bytes"] += 4096
    _refused(d, r"arena_bytes \d+ is more than its allocations reach")


def test_weight_of_another_dtype_or_shape(bases):
    d = bases["gpt"].copy()
    fqn = "blocks.0.ln1.weight"
    d.weights[fqn] = d.weights[fqn].double()
    _refused(d, r"weight 'blocks.0.ln1.weight' is float64\[16\], the program expects float32\[16\]")
    d = bases["gpt"].copy()
    d.weights[fqn] = d.weights[fqn].reshape(4, 4)
    _refused(d, r"weight 'blocks.0.ln1.weight' is float32\[4, 4\], the program expects float32\[16\]")
    d = bases["golden_v1"].copy()  # v1: no weight specs, but the kernel's argument dtype is known
    d.weights["ln.weight"] = d.weights["ln.weight"].double()
    _refused(d, r"argument \d+ 'w1' is float64, the kernel's in_ptr\d is float32")


def test_extern_off_the_allow_list_or_with_malformed_arguments(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "extern")
    p["instructions"][i]["target"] = "builtins.eval"
    _refused(d, rf"instruction {i} \(extern builtins.eval\): calls 'builtins.eval', which is not on")
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "extern", lambda ins: ins["target"] == "aten.mm.out")
    p["instructions"][i]["args"][1] = 3
    _refused(d, rf"instruction {i} \(extern aten.mm.out\): argument 'mat2' of aten.mm.default expects Tensor, got 3")
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    p["instructions"][i]["args"][0]["shape"][-1] -= 1  # still inside its buffer; the reduction dims disagree
    _refused(d, rf"instruction {i} \(extern aten.mm.out\): arguments rejected by aten.mm.out: RuntimeError")


def test_use_after_free_and_free_of_undefined(bases):
    d = bases["gpt"].copy()
    p = d.parts["program.forward"]
    i = _first(p, "launch")
    p["instructions"].insert(i, {"op": "free", "bufs": [p["instructions"][i]["args"][0]]})
    _refused(d, rf"instruction {i + 1} \(launch \w+\): argument 0 '\w+': buffer '\w+' is used after its free "
                rf"at instruction {i}")
    d = bases["gpt"].copy()
    d.parts["program.forward"]["instructions"].insert(0, {"op": "free", "bufs": ["nope"]})
    _refused(d, r"instruction 0 \(free\): buffer 'nope' is not defined")


def test_train_archive_cross_checks(bases):
    d = bases["train"].copy()
    d.manifest["train"]["n_saved"] += 1
    _refused(d, r"manifest.train.n_saved")
    d = bases["train"].copy()
    spec = d.parts["program.backward"]["inputs"][0]
    spec["shape"] = [7] + spec["shape"]
    _refused(d, r"the backward program's inputs")


def test_step_archive_cross_checks(bases):
    """A fused-step archive: one program, no saved tensors, one scaling kernel per gradient that writes
    exactly that gradient (a kernel writing more would scribble past it)."""
    d = bases["step"].copy()
    assert d.manifest["programs"] == ["step"] and d.manifest["train"]["mode"] == "step"
    d.manifest["train"]["n_saved"] = 1
    _refused(d, r"manifest.train.n_saved")
    d = bases["step"].copy()
    d.manifest["programs"] = ["forward", "backward"]
    _refused(d, r"a step train archive has programs \['step'\]")
    d = bases["step"].copy()
    d.manifest["train"]["scale_kernels"].pop()
    _refused(d, r"manifest.train.scale_kernels")
    d = bases["step"].copy()
    ks = d.manifest["train"]["scale_kernels"]
    sizes = {n: d.parts["kernels"][n]["args"][0]["numel"] for n in ks}
    i = next(i for i, n in enumerate(ks) if sizes[n] != sizes[ks[0]])
    ks[0] = ks[i]  # a kernel for another gradient's size
    _refused(d, r"manifest.train.scale_kernels\[0\]: kernel \w+ does not scale")
    d = bases["step"].copy()
    d.manifest["train"]["scale_kernels"][0] = "aotf_nope"
    _refused(d, r"names kernel 'aotf_nope'")
    d = bases["step"].copy()
    d.manifest["train"]["mode"] = "fused"
    _refused(d, r"manifest.train.mode")
    d = bases["train"].copy()
    d.manifest["train"]["scale_kernels"] = bases["step"].manifest["train"]["scale_kernels"]
    _refused(d, r"a split train archive has no scaling kernels")


def test_staged_backward_cross_checks(bases):
    """A staged backward: programs named by the stage count, each gradient in exactly one stage, and each
    stage's inputs = the saved tensors + the loss + what the previous stage carried on."""
    d = bases["staged"].copy()
    t = d.manifest["train"]
    assert d.manifest["programs"] == ["forward", "backward", "backward_1"] and len(t["stages"]) == 2
    assert t["carries"][0] > 0 and t["carries"][1] == 0
    d = bases["staged"].copy()
    d.manifest["programs"] = ["forward", "backward"]
    _refused(d, r"a split train archive has programs \['forward', 'backward', 'backward_1'\]")
    d = bases["staged"].copy()
    d.manifest["train"]["stages"][1].append(d.manifest["train"]["stages"][0][0])
    _refused(d, r"manifest.train.stages: do not name each gradient exactly once")
    d = bases["staged"].copy()
    d.manifest["train"]["carries"][0] -= 1
    _refused(d, r"manifest.train.carries")
    d = bases["staged"].copy()
    d.manifest["train"]["carries"] = [0, 0]  # the last stage's inputs no longer match what is carried
    _refused(d, r"(inputs|carried)")
    d = bases["staged"].copy()
    s0, s1 = d.manifest["train"]["stages"]
    d.manifest["train"]["stages"] = [s1, s0]  # gradients said to come from the wrong program
    _refused(d, r"manifest.train")
    d = bases["staged"].copy()
    g = d.manifest["train"]["grads"]
    g[1] = list(g[0])  # one parameter owns two gradients: the runtime would hand over one of them
    _refused(d, r"manifest.train.grads\[1\]: names 'param' .* a second time")


def test_validate_program_is_pure_and_names_the_instruction(bases):
    d = bases["golden_v1"]
    prog = copy.deepcopy(d.parts["program.forward"])
    sig = validate_program("forward", prog, d.parts["kernels"], d.weights)
    assert sig.inputs == (("int64", (2, 3)),) and len(sig.outputs) == 2
    prog["instructions"][3]["dtype"] = "float16"
    with pytest.raises(ArchiveError, match=r"program 'forward', instruction 4 \(launch \w+\): argument 4 'red27' is float16, "
                                           r"the kernel's out_ptr1 is float32"):
        validate_program("forward", prog, d.parts["kernels"], d.weights)


def test_cpu_source_must_take_exactly_the_recorded_arguments_and_nothing_evaluated():
    from aotfuse.runtime.interpret import check_source

    head = "import triton\nimport triton.language as tl\n\n@triton.jit\n"
    check_source("k", head + "def k(in_ptr0, out_ptr0):\n    pass\n", ["in_ptr0", "out_ptr0"])
    with pytest.raises(ArchiveError, match=r"takes \(in_ptr0\), the archive's launches pass \(in_ptr0, out_ptr0\)"):
        check_source("k", head + "def k(in_ptr0):\n    pass\n", ["in_ptr0", "out_ptr0"])
    for sig in ("in_ptr0=__import__('os').getpid()", "in_ptr0: print('x')", "*in_ptr0"):
        with pytest.raises(ArchiveError, match="unexpected statement"):
            check_source("k", head + f"def k({sig}):\n    pass\n")


def test_extern_shape_checks_never_import_the_compiler_stack():
    """addmm's, _addmm_activation's and attention's meta kernels import torch._dynamo; the runtime's
    validation must not."""
    code = r"""
import sys
import torch
from aotfuse.runtime import validate as v
from aotfuse.runtime.externs import ALLOWED
R = lambda s, d="float32": v._Ref("b", d, tuple(s), tuple(torch.empty(s, device="meta").stride()))
ov = lambda s: {"t": "o", "shape": list(s), "stride": list(torch.empty(s, device="meta").stride()), "offset": 0}
v._meta_check(ALLOWED["aten.addmm.out"], [R([8]), R([4, 6]), R([6, 8])], {}, ov([4, 8]), "float32", "i0")
v._meta_check(ALLOWED["aten._addmm_activation.out"], [R([8], "bfloat16"), R([4, 6], "bfloat16"), R([6, 8], "bfloat16")],
              {"use_gelu": True}, ov([4, 8]), "bfloat16", "i3")
for bad_args, kw in (([R([8]), R([4, 5]), R([6, 8])], {"use_gelu": True}),  # do not chain
                     ([R([8]), R([4, 6]), R([6, 8])], {"use_gelu": 1})):  # an int where the schema says bool
    try:
        v._meta_check(ALLOWED["aten._addmm_activation.out"], bad_args, kw, ov([4, 8]), "float32", "i4")
    except v.ArchiveError as e:
        print("activation refused:", e)
v._meta_check(ALLOWED["aten.scaled_dot_product_attention.default"], [R([2, 4, 8, 16])] * 3,
              {"is_causal": True}, ov([2, 4, 8, 16]), "float32", "i1")
try:
    v._meta_check(ALLOWED["aten.addmm.out"], [R([8]), R([4, 5]), R([6, 8])], {}, ov([4, 8]), "float32", "i2")
except v.ArchiveError as e:
    print("refused:", e)
bad = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor", "triton")))
print("compiler modules:", bad[:5])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "do not chain" in r.stdout
    assert r.stdout.count("activation refused:") == 2 and "'use_gelu'" in r.stdout, r.stdout
    assert "compiler modules: []" in r.stdout, r.stdout
