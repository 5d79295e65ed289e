"""What each program of an archive holds on the GPU when it runs as CUDA graphs, read off the programs (no GPU).

Per program (runtime/graphs.py says where each lives):
- `arena`: the memory plan's arena. With graphs, the programs of a training step share one per stream
  (`graphs.ArenaPool`): the step holds the largest, not the sum.
- `outputs`: the buffers it returns (distinct; inputs passed through excluded). A graph keeps its output
  set for as long as it lives, so these are held between steps, once per graph instance: a forward's
  saved tensors, a backward's gradients, a stage's carries (`carries_out`, read by the next stage).
- `transient`: what the capture allocates and frees again (its own allocations, `Alloc` offset -1, and the
  results of externs that allocate them, e.g. attention's dq/dk/dv), most bytes live at once: a private
  pool keeps that much reserved for the graph's lifetime (`memory_reserved`, not `memory_allocated`).
  Plus what libraries allocate inside such calls (`library`: attention backward's fp32 accumulators;
  torch's cuBLAS workspace for a matmul that does not take cuBLASLt), sizes unknown here.
- `static`: the static buffers of the inputs a graph copies (a family per stream holds them).
- `lt_matmuls`: matmuls bound to cuBLASLt: their state's workspace (at most `knobs.cublaslt_workspace`).

`archive_memory` lists these for every program and `totals` sums them the way the runtime holds them.
`scripts/stage_memory.py` prints the table for one or more archives (one backward program vs a staged one).
"""
from __future__ import annotations

import dataclasses

from ..contract.program import Alloc, Extern, Free, Program
from ..dtypes import TORCH
from ..knobs import knobs

MiB = 2 ** 20
_LIBRARY = ("attention", "attention_backward", "attention_backward_bias")  # externs whose kernels allocate workspace of their own


def nbytes(shape, dtype: str) -> int:
    n = TORCH[dtype].itemsize
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    name: str
    arena: int
    outputs: int  # distinct returned buffers: the graph's output set
    grads: int  # ... of them: gradients
    carries_out: int  # ... values a stage hands the next one
    saved_out: int  # ... a forward's saved tensors
    inputs: int  # bytes of all inputs (read in place or copied)
    carries_in: int
    static: int  # inputs a graph copies into static buffers
    transient: int  # most bytes of the capture's own allocations live at once (its private pool)
    transient_total: int  # every such allocation of one call
    library: tuple[str, ...]  # externs that allocate inside (attention backward, torch-bound matmuls)
    lt_matmuls: int  # matmuls bound to cuBLASLt (one workspace per executor state)
    torch_matmuls: int  # matmuls through torch's binding (cuBLAS's own workspace, inside the capture)


def allocated_bytes(program: Program) -> dict[str, int]:
    size = {}
    for ins in program.instructions:
        if isinstance(ins, Alloc):
            size[ins.buf] = nbytes(ins.shape, ins.dtype)
        elif isinstance(ins, Extern):
            size[ins.out] = nbytes(ins.shape, ins.dtype)
            size.update((o.out, nbytes(o.shape, o.dtype)) for o in ins.outs)
    return size


def transient(program: Program) -> tuple[int, int]:
    """(peak, total) bytes the program allocates per call outside its arena and does not return."""
    returned = {o.t for o in program.returned}
    live: dict[str, int] = {}
    peak = total = 0
    for ins in program.instructions:
        new = {}
        if isinstance(ins, Alloc) and ins.offset == -1 and ins.buf not in returned:
            new[ins.buf] = nbytes(ins.shape, ins.dtype)
        elif isinstance(ins, Extern) and not ins.out_variant:
            if ins.out not in returned:
                new[ins.out] = nbytes(ins.shape, ins.dtype)
            new.update((o.out, nbytes(o.shape, o.dtype)) for o in ins.outs if o.out not in returned)
        elif isinstance(ins, Free):
            for b in ins.bufs:
                live.pop(b, None)
        live.update(new)
        total += sum(new.values())
        peak = max(peak, sum(live.values()))
    return peak, total


def passthrough(program: Program) -> dict[int, int]:
    """Output k -> input j where the program returns input j as it is."""
    names = [i.buf for i in program.inputs]
    return {k: names.index(o.t) for k, o in enumerate(program.returned) if o.t in names}


def output_roles(program: Program, roles: list[str]) -> dict[str, int]:
    """Bytes of the distinct returned buffers, by the role of the first output that returns each
    (roles[k]: what output k is); inputs passed through count nothing."""
    size = allocated_bytes(program)
    names = {i.buf for i in program.inputs}
    out: dict[str, int] = {}
    seen = set()
    for o, role in zip(program.returned, roles):
        if o.t in names or o.t in seen:
            continue
        seen.add(o.t)
        out[role] = out.get(role, 0) + size.get(o.t, 0)
    return out


def _matmuls(executor) -> tuple[int, int]:
    if executor is None:
        return 0, 0
    lt = sum(not isinstance(v, str) for v in executor.matmuls.values())
    return lt, len(executor.matmuls) - lt


def program_memory(name: str, program: Program, roles: list[str], copied: list[int], executor=None,
                   carries_in: int = 0) -> ProgramMemory:
    """roles: per output, "grad" | "carry" | "saved" | "other"; copied: the inputs a graph copies;
    executor: the linked executor (which matmuls take cuBLASLt), if any; carries_in: how many of the
    last inputs are the previous stage's carries."""
    by_role = output_roles(program, roles)
    peak, total = transient(program)
    ins = [nbytes(i.shape, i.dtype) for i in program.inputs]
    lt, tm = _matmuls(executor)
    lib = tuple(i.target for i in program.instructions if isinstance(i, Extern)
                and i.target.split(".")[1] in _LIBRARY)
    lib += ("torch-bound matmul",) * tm
    return ProgramMemory(name, int(program.arena_bytes), sum(by_role.values()), by_role.get("grad", 0),
                         by_role.get("carry", 0), by_role.get("saved", 0), sum(ins),
                         sum(ins[len(ins) - carries_in:]) if carries_in else 0, sum(ins[i] for i in copied),
                         peak, total, lib, lt, tm)


def _copied(program: Program, bound: set[int], keyed: bool, volatile: set[int] = frozenset()) -> list[int]:
    """The inputs a graph copies (graphs.keyed_inputs with the training runtime's choices)."""
    from .graphs import keyed_inputs

    k = set(keyed_inputs(program, frozenset(bound), knobs.graph_copy_bytes, frozenset(volatile), keyed))
    return [i for i in range(len(program.inputs)) if i not in bound and i not in k]


def train_memory(art) -> list[ProgramMemory]:
    """Per program of a split train archive (forward, then each backward stage), as the training
    runtime graphs them (runtime/training.py: the forward copies the batch, backward programs key
    the saved tensors and read passed-through parameters in place)."""
    info = art.manifest.train
    progs = {n: (art.executors[n].program, art.executors[n]) for n in info.programs}
    fwd, fex = progs["forward"]
    n_p, n_m = len(info.params), len(info.mutated_buffers)
    n_out = len(fwd.returned)
    roles = ["other"] * (1 + n_m) + ["saved"] * (n_out - 1 - n_m)
    rows = [program_memory("forward", fwd, roles, _copied(fwd, set(range(n_p + n_m)), False), fex)]
    through = {k - 1 - n_m: j for k, j in passthrough(fwd).items() if k >= 1 + n_m}
    params = {k for k, j in through.items() if j < n_p + n_m}
    stages = info.stages or (tuple(range(len(info.grads))),)
    for k, name in enumerate(info.programs[1:]):
        prog, ex = progs[name]
        n_g = len(stages[k])
        roles = ["grad"] * n_g + ["carry"] * (len(prog.returned) - n_g)
        c_in = info.carries[k - 1] if k and info.carries else 0
        copied = _copied(prog, params, True, set(through) - params)  # batch tensors passed through: copied
        rows.append(program_memory(name, prog, roles, copied, ex, c_in))
    return rows


@dataclasses.dataclass(frozen=True)
class Totals:
    arena: int  # the shared arena (largest program's)
    outputs: int  # every graph's output set (one instance each)
    carries: int
    static: int
    held: int  # held between steps: arena + outputs + static (cuBLASLt workspaces not included)
    transient_sum: int  # private pools: each graph's own transient peak (what is reserved)
    transient_max: int  # ... were the backward graphs to share one pool: the largest
    lt_states: int  # executor states that bind cuBLASLt matmuls (one workspace each)


def totals(rows: list[ProgramMemory]) -> Totals:
    arena = max((r.arena for r in rows), default=0)
    outs = sum(r.outputs for r in rows)
    static = sum(r.static for r in rows)
    back = [r for r in rows if r.name != "forward"]
    fwd = [r.transient for r in rows if r.name == "forward"]
    tmax = sum(fwd) + max((r.transient for r in back), default=0)
    return Totals(arena, outs, sum(r.carries_out for r in rows), static, arena + outs + static,
                  sum(r.transient for r in rows), tmax, sum(r.lt_matmuls > 0 for r in rows))


def table(rows: list[ProgramMemory]) -> str:
    """A fixed-width table of the rows (MiB) and the totals."""
    head = (f"{'program':12s} {'arena':>7s} {'outputs':>8s} {'grads':>7s} {'carry out':>9s} {'saved':>7s} "
            f"{'inputs':>7s} {'carry in':>8s} {'static':>7s} {'transient':>9s} {'(total)':>8s}  library / matmuls")
    lines = [head]
    for r in rows:
        lib = {}
        for t in r.library:
            lib[t] = lib.get(t, 0) + 1
        libs = ", ".join(f"{n} x {t}" for t, n in lib.items()) or "-"
        lines.append(f"{r.name:12s} {r.arena / MiB:7.1f} {r.outputs / MiB:8.1f} {r.grads / MiB:7.1f} "
                     f"{r.carries_out / MiB:9.1f} {r.saved_out / MiB:7.1f} {r.inputs / MiB:7.1f} "
                     f"{r.carries_in / MiB:8.1f} {r.static / MiB:7.2f} {r.transient / MiB:9.1f} "
                     f"{r.transient_total / MiB:8.1f}  {libs}; cuBLASLt {r.lt_matmuls}")
    t = totals(rows)
    lines.append(f"held between steps: shared arena {t.arena / MiB:.1f} + output sets {t.outputs / MiB:.1f} "
                 f"(carries {t.carries / MiB:.1f}) + static {t.static / MiB:.2f} = {t.held / MiB:.1f} MiB, plus "
                 f"{t.lt_states} cuBLASLt workspaces (one per state, each <= {knobs.cublaslt_workspace / MiB:.0f} MiB)")
    lines.append(f"capture pools (reserved, transient): {t.transient_sum / MiB:.1f} MiB in one pool per graph; "
                 f"{t.transient_max / MiB:.1f} MiB with one pool for the backward graphs; plus library workspaces")
    return "\n".join(lines)
