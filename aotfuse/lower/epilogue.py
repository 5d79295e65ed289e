"""What lowering sees of a matmul's epilogue in the FX graph, before any loop IR exists: which pointwise ops
would fuse into a template's store, how heavy they are, which slow ops they hold and what a template would save
(schedule/templates.py weighs it; lower/matmul.py asks)."""
from __future__ import annotations

import dataclasses

FX_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default", "aten.to.dtype")


def _depends_on(a, node, memo: dict) -> bool:
    """Does a read node's result, directly or not? Only nodes after node in the graph (fx orders its nodes)
    can: the search upward stays among them."""
    if not a > node:
        return a is node
    todo, seen = [a], set()
    while todo:
        x = todo.pop()
        if x is node:
            return True
        if x in seen or not x > node:
            continue
        hit = memo.get(x)
        if hit is not None:
            if hit:
                return True
            continue
        seen.add(x)
        todo.extend(x.all_input_nodes)
    for x in seen:
        memo.setdefault(x, False)
    return False


def _name(t) -> str:
    return str(t).split(".")[1] if str(t).count(".") >= 2 else str(t)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What lowering sees of a matmul's epilogue (epilogue_region)."""

    names: tuple[str, ...]  # distinct op names of the region, casts included
    nodes: int  # pointwise nodes the epilogue would evaluate (casts not counted)
    # passes over the product a template's epilogue saves: 2 (cuBLAS's write and the epilogue kernel's
    # read), 1 (the read only: the product is stored anyway, read outside the region: a pre-activation saved
    # for the backward), 0 (no epilogue kernel to save: what the region computes is read only by reductions,
    # which compute it as they read cuBLAS's product)
    saving: int = 2
    why: str = ""  # what the saving is, for the report
    slow: tuple[str, ...] = ()  # ops of the epilogue that are long instruction sequences (SLOW_OPS)


# Ops whose libdevice sequence is long enough to dominate a template's epilogue (which runs while its tensor
# cores wait): ViT's erf GELU backward in the MLP's dgrad template took 231 us against 157 for cuBLAS and a
# separate kernel, where the tanh GELU backward (as a sigmoid) takes 108 against 130 (H100, 2026-11-27,
# scripts/zoo_gpu.py --profile, scripts/dgelu_probe.py); the cost model charges them (AOTFUSE_MM_SLOW_OP_US)
SLOW_OPS = ("erf", "erfc", "erfinv", "lgamma", "digamma", "i0")


def epilogue_region(node, numel: int, limit: int = 64) -> Epilogue:
    """The pointwise ops over node's numel elements that would fuse into a template's store: its result's
    consumers, directly, through views or casts, or through each other, as long as every other input they
    read is independent of the result (a cast is looked through: a training graph upcasts a bf16 product
    before its GELU backward; a reduction of the result, or an op over it, ends the region). `nodes` counts
    the region's pointwise nodes that are not casts and those of the pointwise producers of its other
    inputs that feed nothing else, which inline into it (the GELU derivative of a saved pre-activation)."""
    from ..opclass import VIEW_OPS
    from .registry import registry

    def category(n) -> str | None:
        info = registry().get(n.target) if n.op == "call_function" else None
        return None if info is None else info.category

    def pointwise(n) -> bool:
        if category(n) != "pointwise":
            return False
        val = n.meta.get("val")
        return not (val is not None and hasattr(val, "numel") and int(val.numel()) != numel)

    memo: dict = {}
    region = {node}
    carriers = {node}  # the product itself, its views and casts
    names: list[str] = []
    count = 0
    todo = [(u, 0) for u in node.users]
    while todo and len(region) < limit:
        user, depth = todo.pop(0)
        if user in region:
            continue
        if user.target in VIEW_OPS:
            if depth < 8:
                region.add(user)
                if any(a in carriers for a in user.all_input_nodes):
                    carriers.add(user)
                todo += [(u, depth + 1) for u in user.users]
            continue
        if not pointwise(user) or any(a not in region and _depends_on(a, node, memo)
                                      for a in user.all_input_nodes):
            continue
        region.add(user)
        if _name(user.target) not in names:
            names.append(_name(user.target))
        if str(user.target) in FX_CASTS:
            if any(a in carriers for a in user.all_input_nodes):
                carriers.add(user)
        else:
            count += 1
        todo += [(u, depth) for u in user.users]
    # the pointwise producers of the region's other inputs that exist only to feed it: recomputed in the
    # epilogue (a GELU derivative of the saved pre-activation). A producer something else reads too is stored
    # anyway and the epilogue loads it (a LayerNorm's output under a residual add).
    side: set = set()
    grew = True
    while grew and len(side) < limit:
        grew = False
        for a in {a for r in region | side if r is not node for a in r.all_input_nodes}:
            if a in side or a in region or a.op != "call_function" or len(side) >= limit:
                continue
            if a.target not in VIEW_OPS and not pointwise(a):
                continue
            if all(u in region or u in side for u in a.users):
                side.add(a)
                grew = True
                if a.target not in VIEW_OPS and str(a.target) not in FX_CASTS:
                    count += 1
    # slow ops among the region's pointwise ancestors, shared or not: a horizontal fusion may bring a shared
    # one into the template too (the GELU the dgrad's epilogue recomputes for fc2's weight gradient)
    near: set = set()
    up = [a for r in region if r is not node for a in r.all_input_nodes if a not in region]
    while up and len(near) < limit:
        a = up.pop()
        if a in near or a in region or a.op != "call_function" or not (a.target in VIEW_OPS or pointwise(a)):
            continue
        near.add(a)
        up.extend(a.all_input_nodes)
    slow = tuple(sorted({_name(n.target) for n in region | near if _name(n.target) in SLOW_OPS}))
    # What does the epilogue save? The epilogue kernel cuBLAS's product needs exists only when a value the
    # region computes is stored (read outside it by anything but a reduction); the product's own write is
    # saved only when nothing outside the region reads it.
    outside = sorted({_name(u.target) for c in carriers for u in c.users if u not in region})
    leaving = [u for r in region - carriers for u in r.users if u not in region]
    stored = bool(count) and any(category(u) != "reduction" for u in leaving)
    if count and leaving and not stored:
        return Epilogue(tuple(names), count, 0, "what the epilogue computes is read only by reductions ("
                        + ", ".join(sorted({_name(u.target) for u in leaving})) + "), which compute it as they read",
                        slow)
    if outside and not stored:
        return Epilogue(tuple(names), count, 0, f"the product is also read by {', '.join(outside)}", slow)
    if outside:
        return Epilogue(tuple(names), count, 1, f"the product is also read by {', '.join(outside)}: the template "
                                                "stores it as well, the epilogue kernel's read of it is saved", slow)
    return Epilogue(tuple(names), count, 2, "", slow)
