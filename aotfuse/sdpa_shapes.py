"""scaled_dot_product_attention's broadcasting of query, key and value, shared by the inference lowering
(lower/extern.py) and the training trace (joint/decomp_train.py).

torch's sdpa broadcasts the leading dims of q [..., L, E], k [..., S, E] and v [..., S, Ev]: Falcon's
multi-query attention passes k and v with one head ([B, 1, S, E]) against a query of H heads. The fused
kernels (ours and the runtime's) take equal leading dims, or grouped-query attention (k and v with a divisor
of the query's heads, `enable_gqa`). So a key and value with one head where the query has H are that (Hk = 1:
exactly the same numbers), and any other broadcast is an expand of the operands to the common leading dims.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Broadcast:
    gqa: bool  # k and v have one head where the query has H: attend as grouped-query attention with Hk = 1
    lead: tuple | None  # expand q, k and v to these leading dims (None: they have them)
    why: str


def plan(q: tuple, k: tuple, v: tuple) -> Broadcast | None:
    """How q, k, v of these shapes attend with equal leading dims (or grouped heads); None when they already
    do (or their ranks differ: torch's own check reports that)."""
    if not (len(q) == len(k) == len(v) >= 3) or not all(type(d) is int for d in (*q, *k, *v)):
        return None  # (dynamic dims: torch's own broadcast, as traced)
    lq, lk, lv = tuple(q[:-2]), tuple(k[:-2]), tuple(v[:-2])
    if lq == lk == lv:
        return None
    if lk == lv and lq[:-1] == lk[:-1] and lk[-1] == 1 and lq[-1] > 1:
        return Broadcast(True, None, f"key and value have 1 head, the query {lq[-1]}: grouped-query attention "
                                     "with one key/value head (no copy)")
    lead = []
    for dims in zip(lq, lk, lv):
        big = max(dims)
        if any(d not in (1, big) for d in dims):
            return None  # not broadcastable: torch's error
        lead.append(big)
    return Broadcast(False, tuple(lead), f"leading dims query {list(lq)}, key {list(lk)}, value {list(lv)} "
                                         f"broadcast to {lead}")
