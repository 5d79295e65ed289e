"""Which saved tensors a training backward may reuse the memory of (its donated inputs).

The forward program returns the loss, the buffer updates, then the saved tensors; the backward program
takes the saved tensors (in that order) and the loss's gradient. Once the backward has read a saved tensor
for the last time its bytes are dead, provided nothing else holds them: autograd frees the saved tensors
after the backward (unless the caller asked to keep the graph: the runtime decides that per call). A saved
tensor is donatable when the forward hands over a whole buffer of its own:

- a buffer the forward computes (not an input or a weight: those are the caller's or the archive's),
- returned whole (offset 0, row-major, every element) and once (no other output, saved or not, views it),
- of any size (with dynamic dims its bytes are an expression of them),

and the backward neither returns it (a gradient that is the saved value itself) nor lacks it. The memory
plan (schedule/memplan.py) then places backward buffers in those bytes after their last read.
"""
from __future__ import annotations

import collections

from ..ir.loop import LoopGraph
from ..ir.sizes import hint, norm, same


def _row_major(shape, stride) -> bool:
    acc = 1
    for d, s in zip(reversed(shape), reversed(stride)):
        if not same(d, 1) and not same(s, acc):
            return False
        acc = acc * d
    return True


def donatable_inputs(forward: LoopGraph, backward: LoopGraph, n_front: int) -> tuple[dict[str, int], str]:
    """({backward input: bytes}, why) for the saved tensors the backward may donate. n_front: the forward's
    outputs before the saved tensors (the loss and the buffer updates)."""
    saved = forward.outputs[n_front:]
    if len(backward.inputs) != len(saved) + 1:
        return {}, (f"none: the backward takes {len(backward.inputs)} inputs, the forward saves {len(saved)} "
                    "(and the loss gradient)")
    fbufs, bbufs = forward.buffer_map, backward.buffer_map
    outside = set(forward.inputs) | {b for b, _ in forward.weights}
    uses = collections.Counter(o.view.buf for o in forward.outputs)
    returned = {o.view.buf for o in backward.outputs}
    out: dict[str, int] = {}
    for o, name in zip(saved, backward.inputs):
        v = o.view
        buf = fbufs.get(v.buf)
        if buf is None or v.buf in outside or uses[v.buf] != 1 or name in returned:
            continue
        if not same(v.offset, 0) or len(v.shape) != len(buf.shape) or \
                not all(same(a, b) for a, b in zip(v.shape, buf.shape)) or not _row_major(v.shape, v.stride):
            continue
        b = bbufs.get(name)
        if b is None or b.dtype != buf.dtype or not same(b.nbytes, buf.nbytes):
            continue
        out[name] = norm(buf.nbytes)
    if not out:
        return {}, "none: no saved tensor is a whole buffer of the forward's own that nothing else returns"
    return out, f"{len(out)} of {len(saved)} saved tensors ({sum(map(hint, out.values())) / 2 ** 20:.1f} MiB)"
