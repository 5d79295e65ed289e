"""One source of truth: what lowering emits is what the runtime allows, and the op taxonomy, the
extern table and the dtype table are the ones every stage reads.

The extern check lowers every op case (export + lower, no codegen or compile: externs are decided at
lowering, and later passes never add or rename one) and the train cases (joint trace + partition +
lower of both programs)."""
from __future__ import annotations

import pytest
import torch

from aotfuse import dtypes, opclass
from aotfuse.export.capture import capture
from aotfuse.export.decomp import KEEP_WHOLE
from aotfuse.joint import trace_joint
from aotfuse.joint.decomp_train import KEEP_WHOLE_TRAIN
from aotfuse.knobs import override
from aotfuse.testing.opcases import CASES, TRAIN_CASES
from aotfuse.partition import partition
from aotfuse.partition import train_graphs
from aotfuse.runtime.externs import ALLOWED, EXTERNS, LEGACY
from aotfuse.ir.loop import Extern
from aotfuse.lower import lower, registry

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _externs(cg, program: str) -> set[str]:
    # Matmuls lower to Triton templates when the cost model prefers them (AOTFUSE_MM=auto); the
    # allow-list is about the library calls a program can make, so the cases lower with cuBLAS kept.
    with override(mm="extern"):
        graph, _ = lower(cg, program)
    return {n.target for n in graph.nodes if isinstance(n, Extern)}


@pytest.fixture(scope="module")
def emitted() -> dict[str, set[str]]:
    """extern target -> the cases whose lowering emits it."""
    out: dict[str, set[str]] = {}
    for case in CASES:
        if case.known_issue:
            continue
        # One dtype a case: which extern an op lowers to depends on its consumers, never on the dtype.
        torch.manual_seed(0)
        model, example = case.make(case.dtypes[0])
        with override(**dict(case.knobs)):
            for t in _externs(capture(model, example), "forward"):
                out.setdefault(t, set()).add(case.name)
    for case in TRAIN_CASES:
        for dt in case.dtypes:
            model, example = case.make(dt)
            joint = trace_joint(model, example)
            fwd, (bwd,), _, _ = train_graphs(joint, partition(joint, 1.0))
            for cg, program in ((fwd, "forward"), (bwd, "backward")):
                for t in _externs(cg, program):
                    out.setdefault(t, set()).add(case.name)
    return out


def test_every_emitted_extern_is_allowed(emitted):
    bad = {t: sorted(cs) for t, cs in emitted.items() if t not in ALLOWED}
    assert not bad, f"lowering emits externs the runtime refuses: {bad}"


def test_nothing_on_the_allow_list_is_dead(emitted):
    dead = sorted(set(ALLOWED) - set(emitted) - LEGACY)
    assert not dead, f"allow-listed externs no op case emits (add a case to aotfuse/testing/opcases.py, or drop them): {dead}"
    revived = sorted(LEGACY & set(emitted))
    assert not revived, f"externs marked legacy that lowering emits again (move them to ExternOp.calls): {revived}"


def test_legacy_externs_are_called_by_a_golden_archive():
    # A legacy entry stays on the allow-list only for archives built before its op got a kernel
    # lowering; the golden archives (artifacts/golden) are those archives.
    from pathlib import Path

    from aotfuse.archive import read_archive
    from aotfuse.runtime.payload import read_payload

    golden = Path(__file__).resolve().parents[1] / "artifacts" / "golden"
    called = {i.target for g in ("v1_model.aotf", "v1_cnn.aotf")
              for p in read_payload(read_archive(golden / g)).programs.values() for i in p.instructions
              if hasattr(i, "target")}
    assert LEGACY and LEGACY <= called, (sorted(LEGACY), sorted(called))


def test_keep_whole_sets_and_registry_externs_come_from_the_table():
    assert set(KEEP_WHOLE) == {e.graph_op for e in EXTERNS if e.inference}
    assert set(KEEP_WHOLE_TRAIN) == {e.graph_op for e in EXTERNS if e.train}
    registered = {op for op, info in registry().items() if info.category == opclass.EXTERN}
    assert registered == {e.graph_op for e in EXTERNS}
    assert {e.graph_op for e in EXTERNS} <= opclass.EXTERN_OPS  # the partition never recomputes them


class _Node:  # op_class looks at .op, .target and (for getitem) .args
    op = "call_function"
    args = ()

    def __init__(self, target):
        self.target = target


# Where the registry files an op under a coarser class than the partition's cost model gives it.
# Today's pairs, pinned: a new one means the two views of an op drifted apart.
_COARSER = {
    ("pointwise", "transcendental"): None,  # any op: lowering does not care how costly a pointwise op is
    ("pointwise", "reduction"): {"aten.max_pool2d_with_indices.default", "aten.max_pool2d.default",
                                 "aten.avg_pool2d.default", "aten.max_pool2d_with_indices_backward.default",
                                 "aten.avg_pool2d_backward.default", "aten._adaptive_avg_pool2d.default",
                                 "aten._adaptive_avg_pool2d_backward.default"},  # windowed pointwise lowering, reduction cost
    ("view", "copy"): {"aten.flip.default"},  # index math to lowering; the partition prices it as a copy
    ("pointwise", "copy"): {"aten.cat.default", "aten.index_select.default", "aten.gather.default",
                            "aten.index.Tensor", "aten.slice_scatter.default", "aten.copy.default",
                            "aten.scatter.value", "aten.scatter.src"},  # a gather by index to lowering; a copy to the cost model
    ("pointwise", "unknown"): {"aten.rsub.Tensor", "aotfuse.pack_bits.default", "aotfuse.unpack_bits.default",
                               # inserted after the partition (saved-tensor encodings), never recomputed
                               "aotfuse.pool_offsets.default", "aotfuse.pool_indices.default"},
    ("structural", "unknown"): {"aten._assert_tensor_metadata.default"},
}


def test_registry_classes_agree_with_the_taxonomy():
    drift = []
    for op, info in registry().items():
        assert info.category in opclass.CLASSES, info.op
        cls = opclass.op_class(_Node(op))
        if cls == info.category:
            continue
        allowed = _COARSER.get((info.category, cls), set())
        if allowed is not None and info.op not in allowed:
            drift.append((info.op, info.category, cls))
    assert not drift, f"registry class vs aotfuse/opclass.py: {drift}"


def test_dtype_table_is_the_one_every_stage_reads():
    from aotfuse.archive import _layout
    from aotfuse.emit import printer
    from aotfuse.runtime import executor, validate
    from aotfuse.ir import loop
    from aotfuse.lower import ctx as lowering_ctx

    assert loop.DTYPES == dtypes.NAMES and loop.ITEMSIZE is dtypes.ITEMSIZE
    assert executor.DTYPES is dtypes.TORCH and validate.DTYPES is dtypes.TORCH
    assert lowering_ctx.TORCH_TO_NAME is dtypes.NAME_OF and _layout.DTYPES is dtypes.STORAGE
    assert set(printer.PTR_TYPE) == set(printer.TL_DTYPE) == set(dtypes.NAMES)
    assert set(dtypes.NAMES) <= set(dtypes.STORAGE)
    for name in dtypes.NAMES:
        assert dtypes.ITEMSIZE[name] == torch.empty((), dtype=dtypes.TORCH[name]).element_size()
