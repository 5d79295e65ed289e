"""Programmatic dependent launch (PDL): a kernel's grid may start while the kernel before it drains.

On sm_90+ the runtime launches a kernel with CUDA's programmatic stream serialization when its
binary says so (contract/kernels.Binary.pdl). Its programs then start as soon as the kernel before
it releases them, instead of after that kernel's last program exits, and each program must wait
(``griddepcontrol.wait``) for the predecessor to complete, with its writes visible, before it
touches memory. That hides a kernel's launch and ramp-up behind its predecessor's tail: about
0.3-0.5 us per kernel in a CUDA graph (H100, scripts/pdl_probe.py), a tenth of a small-batch
forward's GPU time.

With knobs.pdl (opt-in) every kernel source gets a trailing ``AOTF_PDL: tl.constexpr = False``
parameter (True when compiled for sm_90+, emit/compile.py), so the interpreter and sm_80 cubins run
the plain kernel; such an archive is program version 7 even without an sm_90 binary (an older
runtime's source check would refuse the parameter). Without the knob the sources are unchanged:

* the wait is the body's first statement: nothing before it reads or writes global memory, so
  neither a read-after-write nor a write-after-read (an arena slot reused) can race;
* the release (``griddepcontrol.launch_dependents``) comes just before the first store at the
  body's top level, after the main loop: the next kernel's programs take free SM slots during
  this kernel's epilogue. A kernel whose stores are all inside loops (a persistent matmul's tile
  loop, a looped reduction's second pass) releases at exit: releasing inside the loop lets the
  next kernel's waiting programs share SMs with this one's remaining tiles (the matmul chain of
  the probe: 7% slower with an early release, as fast as plain with a late one).

The release is only a hint: the next kernel's wait still waits for this one's completion, so its
place never affects results, only timing.
"""
from __future__ import annotations

import re

from ..contract.kernels import PDL_PARAM as PARAM
from ..knobs import knobs

WAIT = "gdc_wait()"
RELEASE = "gdc_launch_dependents()"
IMPORT = "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait\n"

# a store (or an atomic) at the body's top level: 4 spaces, not inside a loop or a branch
_TOP_STORE = re.compile(r"^    (?:tl\.(?:store|atomic_\w+)\(|\w+\.store\()")


def with_grid_dependency(params: str, body: str) -> tuple[str, str]:
    """A kernel's parameter list and body with the PDL wait and release (see the module docstring).

    `params` is the kernel's comma-separated parameter list, `body` its body indented by 4 spaces."""
    lines = body.split("\n")
    out = [f"    if {PARAM}:", f"        {WAIT}"]
    released = False
    for line in lines:
        if not released and _TOP_STORE.match(line):
            out += [f"    if {PARAM}:", f"        {RELEASE}"]
            released = True
        out.append(line)
    params = f"{params}, {PARAM}: tl.constexpr = False" if params.strip() else f"{PARAM}: tl.constexpr = False"
    return params, "\n".join(out)


def uses_grid_dependency(source: str) -> bool:
    """Does a kernel source take the PDL parameter (emitted by this aotfuse; older sources do not)?"""
    return f"{PARAM}: tl.constexpr" in source


def kernel_text(header: str, params: str, body: str, name: str = "KERNEL_NAME") -> str:
    """A kernel module's text: the imports and helpers (`header`), then the jitted kernel `name`, with the PDL
    wait and release when knobs.pdl asks for them (opt-in). Without it the source is the plain kernel that
    every runtime's source check accepts (an older one refuses the PDL parameter and import)."""
    imports = ""
    if knobs.pdl:
        params, body = with_grid_dependency(params, body)
        imports = IMPORT
    return f"{header}{imports}\n@triton.jit\ndef {name}({params}):\n{body}\n"
