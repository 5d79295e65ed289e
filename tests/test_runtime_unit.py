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
            "aten.addmm.out": ((3,), (5, 7), (7, 3)), "aten._addmm_activation.out": ((3,), (5, 7), (7, 3))}[target]
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
