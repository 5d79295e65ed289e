"""The `report` part: what the build decided, for `aotfuse explain` / `inspect`. Informational:
nothing that runs reads it, so reading it is lenient where the report's history requires
(records written before a field existed are upgraded, see FusionRecord.from_dict).

Typed where a reader uses the fields: the fusion summary, fusion verdicts, inlining, groups and
the memory plan. Two sections stay free-form maps, deliberately: `lowering` (each decision is one
of a few shapes, {addmm, kept, why} | {mm_gelu, producer, approximate, fused, why} | {realize, of, why} |
{folded, into} | {uniform, rtype, n} | {onehot, n}, that grows with the lowering rules) and
`partition` (the min-cut's own record, aotfuse/partition/mincut.py `Partition.report`, shown as it
is). A frozen dataclass holding them treats them as read-only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ._codec import decoding, fields, put_optional, strs


@dataclasses.dataclass(frozen=True)
class FusionSummary:
    loop_ir_nodes: int
    inlined: int
    groups: int
    kernel_launches: int
    unique_kernels: int
    externs: int
    fused_pairs: int
    refused_pairs: int | None  # None in reports written before it was recorded
    refusals: dict  # refusal kind -> count, in first-seen order

    def to_dict(self) -> dict:
        out = {"loop_ir_nodes": self.loop_ir_nodes, "inlined": self.inlined, "groups": self.groups,
               "kernel_launches": self.kernel_launches, "unique_kernels": self.unique_kernels,
               "externs": self.externs, "fused_pairs": self.fused_pairs}
        put_optional(out, "refused_pairs", self.refused_pairs)
        out["refusals"] = dict(self.refusals)
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "FusionSummary":
        d = fields(d, "report fusion_summary", ("loop_ir_nodes", "inlined", "groups", "kernel_launches",
                                                "unique_kernels", "externs", "fused_pairs", "refusals"),
                   ("refused_pairs",))
        return cls(d["loop_ir_nodes"], d["inlined"], d["groups"], d["kernel_launches"], d["unique_kernels"],
                   d["externs"], d["fused_pairs"], d.get("refused_pairs"), dict(d["refusals"]))


@dataclasses.dataclass(frozen=True)
class FusionRecord:
    """One fusion, or one distinct refused pair: `reason` is the refusal kind (a FuseRefusal value,
    None when fused), `detail` what was found (for a fusion: the bytes it saves)."""

    a: str
    b: str
    kind: str  # "vertical" | "horizontal"
    score: int  # bytes of memory traffic fusing saves (would save)
    fused: bool
    reason: str | None
    detail: str

    @property
    def text(self) -> str:
        """'kind: detail' for a refusal, the detail ('saves N bytes') for a fusion."""
        if self.reason is None:
            return self.detail
        return f"{self.reason}: {self.detail}" if self.detail else self.reason

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "kind": self.kind, "score": self.score, "fused": self.fused,
                "reason": self.reason, "detail": self.detail}

    @classmethod
    def from_dict(cls, d: Any) -> "FusionRecord":
        d = fields(d, "report fusion record", ("a", "b", "kind", "score", "fused", "reason"), ("detail",))
        reason, detail = d["reason"], d.get("detail")
        if detail is None and "detail" not in d:  # written before kinds and details were separate
            if d["fused"]:
                reason, detail = None, reason
            else:
                kind, _, rest = reason.partition(":")
                reason, detail = kind.strip(), rest.strip()
        return cls(d["a"], d["b"], d["kind"], d["score"], d["fused"], reason, detail or "")


@dataclasses.dataclass(frozen=True)
class InlineRecord:
    producer: str
    consumer: str
    reason: str

    def to_dict(self) -> dict:
        return {"producer": self.producer, "consumer": self.consumer, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Any) -> "InlineRecord":
        d = fields(d, "report inline record", ("producer", "consumer", "reason"))
        return cls(d["producer"], d["consumer"], d["reason"])


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """A scheduled group: a kernel (named `kernel`) or an extern (`kernel` None)."""

    name: str
    kind: str  # "extern" or a kernel kind
    nodes: tuple[str, ...]
    xnumel: int
    rnumel: int
    kernel: str | None
    # a kernel's launch shape and why (emit/space.block_choice): {kind, pattern, xblock, rblock,
    # num_warps, grid, why}; free-form, None for externs and in reports written before it existed
    blocks: dict | None = None

    def to_dict(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "nodes": list(self.nodes), "xnumel": self.xnumel,
               "rnumel": self.rnumel, "kernel": self.kernel}
        put_optional(out, "blocks", self.blocks)
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "GroupRecord":
        d = fields(d, "report group", ("name", "kind", "nodes", "xnumel", "rnumel", "kernel"), ("blocks",))
        return cls(d["name"], d["kind"], strs(d["nodes"]), d["xnumel"], d["rnumel"], d["kernel"],
                   None if d.get("blocks") is None else dict(d["blocks"]))


@dataclasses.dataclass(frozen=True)
class MemorySummary:
    arena_bytes: int
    naive_bytes: int  # what the buffers would take without reuse
    buffers: int
    bound_extern_results: int
    peak_live_bytes: int = 0  # most bytes live at once (no plan is smaller); 0 in older reports
    plan: str = ""  # which offset plan won (schedule/memplan.py): "greedy-by-size" | "slots"
    donated_bytes: int = 0  # a training backward's buffers placed in saved tensors it no longer reads
    donation: str = ""  # what that placement did, or why none (a backward's report only)

    def to_dict(self) -> dict:
        d = {"arena_bytes": self.arena_bytes, "naive_bytes": self.naive_bytes, "buffers": self.buffers,
             "bound_extern_results": self.bound_extern_results}
        put_optional(d, "peak_live_bytes", self.peak_live_bytes, 0)
        put_optional(d, "donated_bytes", self.donated_bytes, 0)
        put_optional(d, "donation", self.donation, "")
        return put_optional(d, "plan", self.plan, "")

    @classmethod
    def from_dict(cls, d: Any) -> "MemorySummary":
        d = fields(d, "report memory", ("arena_bytes", "naive_bytes", "buffers", "bound_extern_results"),
                   ("peak_live_bytes", "plan", "donated_bytes", "donation"))
        return cls(d["arena_bytes"], d["naive_bytes"], d["buffers"], d["bound_extern_results"],
                   d.get("peak_live_bytes", 0), d.get("plan", ""), d.get("donated_bytes", 0), d.get("donation", ""))


@dataclasses.dataclass(frozen=True)
class Report:
    """One program's decisions; the forward's report also holds the backward's and the partition."""

    fusion_summary: FusionSummary
    fusion: tuple[FusionRecord, ...]  # each fusion, and each distinct refused pair once, best-first
    inline: tuple[InlineRecord, ...]
    lowering: tuple[dict, ...]  # free-form, see the module docstring
    groups: tuple[GroupRecord, ...]  # in execution order
    memory: MemorySummary
    backward: "Report | None" = None
    partition: dict | None = None  # free-form, see the module docstring
    # each reduction's split decision (schedule/split.py SplitDecision.to_report: node, rtype, pattern,
    # x, r, split, chunks, chunk, how, partial, reason); free-form like `lowering`; () when none
    splits: tuple[dict, ...] = ()
    # a staged backward (partition/stages.py): the reports of programs backward_1, backward_2, ...
    stages: tuple["Report", ...] = ()

    def to_dict(self) -> dict:
        out = {"fusion_summary": self.fusion_summary.to_dict(), "fusion": [f.to_dict() for f in self.fusion],
               "inline": [i.to_dict() for i in self.inline]}
        if self.splits:
            out["splits"] = [dict(x) for x in self.splits]
        out.update({"lowering": [dict(x) for x in self.lowering], "groups": [g.to_dict() for g in self.groups],
                    "memory": self.memory.to_dict()})
        if self.backward is not None:
            out["backward"] = self.backward.to_dict()
        if self.stages:
            out["stages"] = [r.to_dict() for r in self.stages]
        if self.partition is not None:
            out["partition"] = self.partition
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Report":
        with decoding("part 'report'"):
            d = fields(d, "part 'report'", ("fusion_summary", "fusion", "inline", "lowering", "groups", "memory"),
                       ("backward", "partition", "splits", "stages"))
            for x in list(d["lowering"]) + list(d.get("splits", ())):
                fields(x, "report lowering record", (), tuple(x) if type(x) is dict else ())
            back, part = d.get("backward"), d.get("partition")
            if part is not None:
                fields(part, "report partition", ("saved_bytes", "saved"), tuple(part) if type(part) is dict else ())
            return cls(FusionSummary.from_dict(d["fusion_summary"]),
                       tuple(FusionRecord.from_dict(x) for x in d["fusion"]),
                       tuple(InlineRecord.from_dict(x) for x in d["inline"]), tuple(dict(x) for x in d["lowering"]),
                       tuple(GroupRecord.from_dict(x) for x in d["groups"]), MemorySummary.from_dict(d["memory"]),
                       None if back is None else Report.from_dict(back), part,
                       tuple(dict(x) for x in d.get("splits", ())),
                       tuple(Report.from_dict(x) for x in d.get("stages", ())))
