"""Runtime pieces that need no GPU: arch selection, extern allow-list, program validation."""
from __future__ import annotations

import pytest
import torch

from aotfuse.contract import Program
from aotfuse.errors import ArchiveError, GuardError
from aotfuse.runtime import gpu
from aotfuse.runtime.executor import Executor
from aotfuse.runtime.externs import ALLOWED, BINDINGS, resolve
from aotfuse.runtime.interpret import check_source


@pytest.mark.parametrize("cc,have,want", [(90, ["sm_80", "sm_90"], "sm_90"), (80, ["sm_80", "sm_90"], "sm_80"),
                                          (86, ["sm_80", "sm_90"], "sm_80"), (89, ["sm_80"], "sm_80")])
def test_pick_arch(monkeypatch, cc, have, want):
    monkeypatch.setattr(gpu, "device_arch", lambda i: cc)
    assert gpu.pick_arch(have, torch.device("cuda", 0)) == want


def test_pick_arch_refuses_missing_arch_naming_it(monkeypatch):
    monkeypatch.setattr(gpu, "device_arch", lambda i: 90)
    with pytest.raises(GuardError, match=r"cubins for sm_80 but cuda:0 is sm_90.*--arch sm_90"):
        gpu.pick_arch(["sm_80"], torch.device("cuda", 0))
    monkeypatch.setattr(gpu, "device_arch", lambda i: 100)
    with pytest.raises(GuardError, match="sm_100"):
        gpu.pick_arch(["sm_80", "sm_90"], torch.device("cuda", 0))


def test_externs_only_from_allow_list():
    assert resolve("aten.embedding.out") is torch.ops.aten.embedding.out
    assert resolve("aten.mm.out") is torch.mm  # a faster binding of the same op (BINDINGS)
    for bad in ("aten.mm", "os.system", "builtins.eval", "torch.ops.aten.mm.out"):
        with pytest.raises(ArchiveError, match="allow-list"):
            resolve(bad)


def test_attention_binding_matches_its_overload():
    # called as the executor calls it: (q, k, v, mask) positional, the rest by keyword
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    mask = torch.randn(5, 5, generator=g)
    target = "aten.scaled_dot_product_attention.default"
    for m, kw in ((None, {"is_causal": True, "scale": None, "enable_gqa": False, "dropout_p": 0.0}),
                  (mask, {"is_causal": False, "scale": 0.3, "enable_gqa": False, "dropout_p": 0.0})):
        ref = ALLOWED[target](q, k, v, m, **kw)
        torch.testing.assert_close(BINDINGS[target](q, k, v, m, **kw), ref, rtol=0, atol=0)


@pytest.mark.parametrize("target", sorted(t for t in BINDINGS if t.endswith(".out")))
def test_extern_bindings_match_their_overloads(target):
    # The binding is called exactly as the overload would be: positional args, beta/alpha, out=.
    g = torch.Generator().manual_seed(0)
    mats = {"aten.mm.out": ((5, 7), (7, 3)), "aten.bmm.out": ((2, 5, 7), (2, 7, 3)),
            "aten.addmm.out": ((3,), (5, 7), (7, 3)), "aten._addmm_activation.out": ((3,), (5, 7), (7, 3)),
            "aotfuse.mm_residual.out": ((5, 7), (7, 3), (5, 3), (3,))}[target]
    args = [torch.randn(s, generator=g) for s in mats]
    kwargs = {"beta": 0.5, "alpha": 2.0} if target in ("aten.addmm.out", "aten._addmm_activation.out") else {}
    for extra in ([{"use_gelu": False}, {"use_gelu": True}] if target == "aten._addmm_activation.out" else [{}]):
        ref = ALLOWED[target](*args, **kwargs, **extra, out=torch.empty(0))
        if extra.get("use_gelu"):
            # torch's CPU kernel applies the erf GELU, its CUDA kernels (cuBLASLt's epilogue) the tanh one: the
            # binding computes the CUDA one on every device (the program's GELU is the model's tanh GELU)
            erf = ref
            ref = torch.nn.functional.gelu(torch.addmm(*args, **kwargs), approximate="tanh")
            assert not torch.equal(erf, ref)
        out = torch.empty_like(ref)
        res = BINDINGS[target](*args, **kwargs, **extra, out=out)
        assert res is out
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_program_with_unknown_instruction_or_kernel_is_refused():
    prog = {"version": 2, "inputs": [], "weights": {}, "arena_bytes": 0, "instructions": [{"op": "exec", "code": "x"}]}
    with pytest.raises(ArchiveError, match="unknown program instruction 'exec'"):
        Program.from_dict(prog)
    prog["instructions"] = [{"op": "launch", "kernel": "k", "grid": [1, 1, 1], "args": []}]
    with pytest.raises(ArchiveError, match="kernel 'k'"):
        Executor(Program.from_dict(prog), {}, {}, torch.device("cpu"))


def test_cpu_path_refuses_foreign_source():
    good = ("import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(in_ptr0):\n"
            "    tl.store(in_ptr0, 1)\n")
    check_source("k", good)
    with pytest.raises(ArchiveError, match="unexpected statement"):
        check_source("k", "import os\n" + good)
    with pytest.raises(ArchiveError, match="unexpected statement"):
        check_source("k", good + "print('hi')\n")
    with pytest.raises(ArchiveError, match="does not define it"):
        check_source("other", good)


class _Inner:
    """A stand-in bound launch: records what it was called or prepared with."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, stream, args, **kw):
        self.calls.append((grid, stream, list(args), kw))

    def prepare(self, grid):
        class P:
            global_scratch, keep = 0, None
        p = P()
        p.grid = grid
        return p


def test_persistent_launch_clamps_the_grid_to_programs_per_sm():
    inner = _Inner()
    launch = gpu.PersistentLaunch(inner, 2 * 132)
    launch((1536, 1, 1), 7, [1, 2])
    launch((100, 1, 1), 7, [1, 2])
    assert [c[0] for c in inner.calls] == [(264, 1, 1), (100, 1, 1)]
    assert launch.prepare((4096, 1, 1)).grid == (264, 1, 1)


def test_scratch_launch_gives_each_launch_site_its_own_scratch():
    inner = _Inner()
    launch = gpu.ScratchLaunch(inner, 256, torch.device("cpu"))
    a, b = launch.prepare((132, 1, 1)), launch.prepare((132, 1, 1))
    assert a.keep.numel() == b.keep.numel() == 132 * 256 and a.global_scratch != b.global_scratch
    assert a.global_scratch == a.keep.data_ptr()
    launch((3, 1, 1), 0, [5])
    assert inner.calls[0][3]["global_scratch"] != 0
    # persistent and scratch together: the scratch covers the clamped grid only
    both = gpu.PersistentLaunch(gpu.ScratchLaunch(_Inner(), 256, torch.device("cpu")), 132)
    assert both.prepare((4096, 1, 1)).keep.numel() == 132 * 256


def test_grid_launch_replaces_the_programs_grid():
    """A binary with its own tiles (contract/kernels.Binary.grid): the program's grid (the entry's tiles) is
    replaced before persistence clamps it and scratch is sized for it (runtime/gpu.make_launchers' order)."""
    inner = _Inner()
    launch = gpu.GridLaunch(gpu.PersistentLaunch(gpu.ScratchLaunch(inner, 256, torch.device("cpu")), 132),
                            (256, 1, 1))
    launch((512, 1, 1), 0, [1])
    assert inner.calls[0][0] == (132, 1, 1)
    p = launch.prepare((512, 1, 1))
    assert p.grid == (132, 1, 1) and p.keep.numel() == 132 * 256
    plain = gpu.GridLaunch(_Inner(), (16, 1, 1))  # not persistent: exactly its own grid
    plain((512, 1, 1), 0, [])
    assert plain.inner.calls[0][0] == (16, 1, 1)


def test_persistent_entry_round_trips_and_is_validated():
    import dataclasses

    from aotfuse.contract.kernels import Binary, KernelArg, KernelEntry
    from aotfuse.runtime.validate_kernels import validate_kernels

    b = Binary(b"\x7fELF", "k", 8, 1024, 256, 0)
    k = KernelEntry("template_mm", ("mm0",), (1536, 1, 1), 8, 32768, 64, 1536 * 32768, 1,
                    (KernelArg("out_ptr0", "bfloat16", "out", 8192 * 3072),), {"sm_90": b}, persistent=1)
    d = k.to_dict()
    assert d["persistent"] == 1 and KernelEntry.from_dict(d).persistent == 1
    assert "persistent" not in dataclasses.replace(k, persistent=0).to_dict()
    validate_kernels({"k": d})
    with pytest.raises(ArchiveError, match="persistent"):
        validate_kernels({"k": dict(d, kind="pointwise")})
    with pytest.raises(ArchiveError, match="persistent"):
        validate_kernels({"k": dict(d, persistent=99)})
