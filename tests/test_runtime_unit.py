"""Runtime pieces that need no GPU: arch selection, extern allow-list, program validation."""
from __future__ import annotations

import pytest
import torch

from aotfuse.contract import Program
from aotfuse.errors import ArchiveError, GuardError
from aotfuse.runtime import gpu
from aotfuse.runtime.executor import Executor
from aotfuse.runtime.externs import resolve
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
    assert resolve("aten.mm.out") is torch.ops.aten.mm.out
    for bad in ("aten.mm", "os.system", "builtins.eval", "torch.ops.aten.mm.out"):
        with pytest.raises(ArchiveError, match="allow-list"):
            resolve(bad)


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
