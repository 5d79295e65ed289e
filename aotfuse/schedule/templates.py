"""Matmul templates: template or cuBLAS (the cost model), what may fuse into a template, and which
producers are inlined into its operands (prologues).

Choice (made at lowering, where the FX graph still shows a matmul's consumers), `AOTFUSE_MM`:
- `extern`: every matmul calls cuBLAS (aten mm/addmm/bmm .out), epilogues run as separate kernels;
- `template`: every floating-point matmul is a Triton template (emit/template_mm.py);
- `heavy`: as `auto` for the matmuls whose epilogue lowering found heavy (lower/epilogue.epilogue_region: a
  GELU, its backward), cuBLAS for every other (knobs.py says which is the default, and why);
- `auto`: the cheaper of the two by a small model, in microseconds:
    extern   = mm_extern_us + flops / throughput
               + if the epilogue stays outside: a round trip of the M x N output at mm_bandwidth_gbs
                 (no launch: the epilogue fuses into the kernel that reads it next, a residual add
                 into the LayerNorm after it)
               + per operand copy cuBLAS needs (a cast, a non-strided view): launch + its round trip
    template = launch + flops / (throughput * efficiency * tile utilization * wave utilization), the
               efficiency mm_ws_efficiency for a warp-specialized persistent (TMA) kernel,
               mm_template_efficiency for a flattened persistent one, mm_tile_efficiency for one
               program per tile; wave utilization tiles / (waves x SMs) once there is more than one wave
  so a template wins when its epilogue saves more than the template's slower main loop costs, or
  the matmul is small enough that a launch beats a library call; cuBLAS keeps large plain matmuls.
  Measured (H200, 2026-11-26, scripts/tune_mm.py and scripts/mm_profile.py on the anchor GPT): at
  8192 rows the persistent templates' main loops reach 0.86-0.88 of cuBLAS at K = 768, one program
  per tile at 1024 rows 0.40-0.82 (qkv 14.5 vs 8.9 us), and a residual add
  costs the cuBLAS path one extra round trip inside the next LayerNorm, not a kernel; at 128 rows
  templates and cuBLAS tie per matmul. Warp-specialized (later the same day, scripts/tune_mm.py at 8192
  rows, template / cuBLAS): qkv 56.3 / 50.7 us, head 171.9 / 170.4, proj with its residual 65.8 / 67.0,
  out with its residual 24.6 / 26.8, fc with the GELU 83.7 / 69.8 (cuBLASLt's GELU_BIAS).
Each decision, with the two estimates, the tile configuration and why, goes into the report's
`lowering` records.

Fusion (called by fusion.can_fuse): a template group holds one MatMul and pointwise nodes over its
(B x) M x N output space that read the group's values at their own point (the epilogue). Refused,
with a reason: a second matmul, a reduction, a node over another space, a read at another index,
and a node that feeds the matmul's operands.
"""
from __future__ import annotations

from ..emit.mm_configs import choose_config, known_targets, pricing_sms, pricing_target, tile_count
from ..ir.loop import ITEMSIZE, Cast, Const, IndexValue, Load, Op, Pointwise, Reduction, expr_op_count
from ..ir.matmul import MatMul, is_matmul
from ..knobs import knobs

MODES = ("auto", "heavy", "template", "extern")
CASTS = ("_to_copy", "convert_element_type", "to", "type_as")  # epilogue op names that only change the dtype
TEMPLATE_DTYPES = ("bfloat16", "float16", "float32")


def mode() -> str:
    m = (knobs.mm or "heavy").lower()
    if m not in MODES:
        from ..errors import BuildError

        raise BuildError(f"AOTFUSE_MM={knobs.mm!r}", remedy=f"use one of {', '.join(MODES)}")
    return m


def estimate(b: int, m: int, n: int, k: int, dtype: str, epilogue_kernels: int, operand_copies: int,
             bias_in_library: bool, config, sms: int = 132, epilogue_passes: int = 2) -> dict:
    """The two cost estimates (us) of one matmul; `epilogue_passes`: the passes over the product an
    epilogue kernel costs the extern side (2: cuBLAS's write and its read; 1: the read, the product being
    stored either way)."""
    flops = 2.0 * b * m * n * k
    tput = knobs.mm_tflops * (0.1 if dtype == "float32" else 1.0) * 1e6  # flops per us
    bw = knobs.mm_bandwidth_gbs * 1e3  # bytes per us
    out_bytes = b * m * n * ITEMSIZE[dtype]
    t_lib = flops / tput
    extern = knobs.mm_extern_us + t_lib
    extern += epilogue_kernels * (epilogue_passes * out_bytes / bw)
    extern += operand_copies  # (launch + the operand's round trip) each, precomputed by the caller
    pad_m = -(-m // config.block_m) * config.block_m
    pad_n = -(-n // config.block_n) * config.block_n
    util = (m * n) / (pad_m * pad_n)
    # a persistent kernel (operands through TMA) vs one program per tile (pointer loads)
    # (TMA needs an unbatched matmul and AOTFUSE_MM_TMA; emit/template_mm.tma_operand may still refuse an
    # operand that is not one aligned strided load, which this estimate does not see)
    tma = bool(config.persistent) and b == 1 and knobs.mm_tma
    eff = (knobs.mm_ws_efficiency if config.warp_spec else knobs.mm_template_efficiency) if tma \
        else knobs.mm_tile_efficiency
    # Wave quantization: the template's fixed tile over more tiles than SMs leaves the last wave part
    # empty (1024 x 2304 in 128 x 128 tiles: 144 tiles on 132 SMs run as two waves); cuBLAS picks its
    # tile per problem, so only the template pays. One partial wave (fewer tiles than SMs) is latency-bound
    # and not charged.
    tiles = tile_count(b, m, n, config)
    waves = -(-tiles // sms)
    wave = tiles / (waves * sms) if waves > 1 else 1.0
    template = knobs.launch_overhead_us + t_lib / (eff * util * wave)
    return {"template": round(template, 2), "extern": round(extern, 2), "tile_utilization": round(util, 3),
            "wave_utilization": round(wave, 3), "bias_in_library": bias_in_library}


def choose(name: str, origin: str, b: int, m: int, n: int, k: int, dtype: str, *, epilogue: list[str],
           bias: bool, operand_copy_us: float, operand_copies: list[str], targets=None,
           heavy_epilogue: bool = False, epilogue_saving: tuple[int, str] = (2, ""), slow_ops=()) -> dict:
    """Template or extern for one matmul; the returned record goes into the report."""
    md = mode()
    rec = {"matmul": name, "op": origin, "shape": {"B": b, "M": m, "N": n, "K": k}, "dtype": dtype, "mode": md,
           "epilogue": list(epilogue), "prologue": list(operand_copies)}
    if dtype not in TEMPLATE_DTYPES:
        rec.update(choice="extern", why=f"{dtype} matmuls have no template")
        return rec
    if max(b * m * k, b * k * n, b * m * n) > 2**31 - 1:
        rec.update(choice="extern", why="an operand indexes more than 2**31 elements (32-bit template indexing)")
        return rec
    targets = targets or knobs.targets
    cfg, cfg_why = choose_config(b, m, n, k, dtype, targets, heavy_epilogue)
    sms = pricing_sms(targets)
    if len(known_targets(targets)) > 1:
        # each target compiles its own tiles (emit/mm_configs.target_configs); the choice is one per archive
        cfg_why = f"priced for {pricing_target(targets)}, the newest target: {cfg_why}"
    rec.update(config=cfg.as_dict(), config_why=cfg_why)
    if heavy_epilogue:
        rec["heavy_epilogue"] = True
    # Epilogue kernels the extern path needs: a bias cuBLAS cannot add in its call (addmm adds it
    # only when nothing else consumes the product), and the pointwise consumers. A cast alone saves no
    # round trip: its consumer casts as it reads cuBLAS's output, while a template would store the wider
    # result (H200, 2026-11-26: the anchor's training step with fp32 casts fused into templates lost).
    separate = 1 if [e for e in epilogue if e not in CASTS] else 0
    passes, saving_why = epilogue_saving
    est = estimate(b, m, n, k, dtype, separate, operand_copy_us, bias and not epilogue, cfg, sms,
                   epilogue_passes=passes)
    slow_us = 0.0
    if separate and slow_ops:
        # a long libdevice sequence (erf) in the epilogue runs while the template's tensor cores wait
        slow_us = round(len(slow_ops) * b * m * n * 1e-6 * knobs.mm_slow_op_us, 2)
        est["template"] = round(est["template"] + slow_us, 2)
        est["slow_ops_us"] = slow_us
    rec["cost_us"] = est
    if md == "heavy" and not heavy_epilogue:
        rec.update(choice="extern", why="AOTFUSE_MM=heavy: only a matmul with a heavy epilogue (a GELU, its "
                                        "derivative) is weighed against cuBLAS")
        return rec
    if md not in ("auto", "heavy"):
        rec.update(choice=md, why=f"AOTFUSE_MM={md}")
        return rec
    if epilogue and not separate:
        rec.update(choice="extern", why=f"the epilogue ({', '.join(epilogue)}) only casts: its consumer casts as it "
                                        "reads cuBLAS's result, a template would store the wider one")
        return rec
    if epilogue and separate and not passes:
        rec.update(choice="extern", why=f"the epilogue ({', '.join(epilogue)}) saves no pass over the product: "
                                        f"{saving_why}")
        return rec
    if est["template"] <= est["extern"]:
        parts = []
        if epilogue:
            parts.append(f"epilogue ({', '.join(epilogue)}) saves "
                         + (f"a round trip of the {m}x{n} output" if passes == 2 else f"a pass over the {m}x{n} "
                            f"output ({saving_why})"))
        if operand_copies:
            parts.append(f"prologue ({', '.join(operand_copies)}) saves an operand copy")
        if not parts:
            parts.append("small enough that a launch beats a library call")
        why = "; ".join(parts)
        rec.update(choice="template", why=f"{why}: {est['template']} us <= cuBLAS {est['extern']} us")
    else:
        rec.update(choice="extern", why=f"cuBLAS {est['extern']} us < template {est['template']} us"
                                        + ("" if epilogue else " (plain matmul: nothing to fuse)")
                                        + (f" (of which {slow_us} us for {', '.join(slow_ops)} in the epilogue, "
                                           "AOTFUSE_MM_SLOW_OP_US)" if slow_us else ""))
    return rec


def library_epilogue_estimate(m: int, n: int, k: int, dtype: str) -> dict:
    """The two estimates of a matmul whose epilogue both sides fuse (cuBLASLt's own epilogue or C, the
    template's store): no epilogue round trip on either side."""
    cfg, _ = choose_config(1, m, n, k, dtype, knobs.targets)
    return estimate(1, m, n, k, dtype, 0, 0.0, True, cfg, pricing_sms(knobs.targets))


def library_epilogue_choice(m: int, n: int, k: int, dtype: str, what: str) -> tuple[bool, str]:
    """AOTFUSE_MM=auto, a matmul whose epilogue cuBLASLt can apply itself (export/mm_gelu.py's tanh GELU,
    lower/residual.py's residual add) asks before it is rewritten: (keep cuBLAS with the epilogue in the
    call?, why). The other side is the template with the same epilogue; both write the result once, so only
    the matmuls differ."""
    if dtype not in TEMPLATE_DTYPES:
        return True, f"{dtype} matmuls have no template"
    if not (m and n and k):
        return True, f"an empty matmul ({m}x{n}x{k}): nothing to time"
    est = library_epilogue_estimate(m, n, k, dtype)
    if est["extern"] <= est["template"]:
        return True, (f"cuBLASLt {est['extern']} us <= template {est['template']} us "
                      f"({m}x{n}x{k}; both fuse {what})")
    return False, (f"the template {est['template']} us < cuBLASLt {est['extern']} us ({m}x{n}x{k}; both fuse "
                   f"{what})")


def gelu_epilogue_choice(m: int, n: int, k: int, dtype: str) -> tuple[bool, str]:
    """library_epilogue_choice for a tanh GELU over a biased matmul (cuBLASLt's GELU_BIAS epilogue)."""
    return library_epilogue_choice(m, n, k, dtype, "the bias and the GELU")


# ---------------------------------------------------------------- fusion

def _template_of(st, g: str) -> str | None:
    for n in st.members[g]:
        if is_matmul(st.nodes[n]):
            return n
    return None


def fusion_refusal(st, a: str, b: str) -> str | None:
    """Why groups a and b may not fuse because of a matmul template (None: templates allow it)."""
    ta, tb = _template_of(st, a), _template_of(st, b)
    if ta is None and tb is None:
        return None
    if ta is not None and tb is not None:
        return f"two matmul templates ({ta}, {tb}) in one kernel"
    t, other, tg = (ta, b, a) if ta is not None else (tb, a, b)
    mm: MatMul = st.nodes[t]
    x = mm.numel
    inside = set(st.members[tg])
    outside = set(st.members[other])
    for n in st.members[other]:
        node = st.nodes[n]
        if isinstance(node, Reduction):
            return f"{n} is a reduction: a matmul template's epilogue is pointwise over its output"
        if not isinstance(node, Pointwise):
            return f"{n} is not pointwise"
        if node.numel != x:
            return f"{n} iterates over {node.numel} elements, the matmul {t} over {x}"
        for i, ld in enumerate(st.loads(n)):
            if ld.buf in inside and st.read_kind(n, i, 1) != "point":
                return f"{n} reads {ld.buf}[{ld.index}] at another index than the template computes it"
    # A heavy epilogue runs in the template's consumer warps while its tensor cores wait (no ping-pong in
    # Triton 3.6's Hopper schedule): H200, 2026-11-26, the anchor GPT's GELU backward (39 ops) in the MLP's
    # dgrad template took 210 us against 132 for cuBLAS and a separate kernel (168 registers, spills).
    ops = sum(expr_op_count(st.nodes[n].body) for n in (*st.members[tg], *st.members[other])
              if not is_matmul(st.nodes[n]) and isinstance(st.nodes[n], Pointwise))
    if ops > knobs.mm_epilogue_max_ops:
        return (f"the epilogue would hold {ops} ops (> AOTFUSE_MM_EPILOGUE_OPS={knobs.mm_epilogue_max_ops}): it runs "
                "while the template's tensor cores wait")
    # Nothing in the template group may read the other group at another index either, and the
    # matmul's operands may not come from a fused node (they are loaded tile by tile along K).
    for ld in st.loads(t):
        if ld.buf in outside:
            return f"{ld.buf} feeds the operand of matmul {t} (loaded along K, not at the output point)"
    for n in st.members[tg]:
        if n == t:
            continue
        for i, ld in enumerate(st.loads(n)):
            if ld.buf in outside and st.read_kind(n, i, 1) != "point":
                return f"{n} reads {ld.buf}[{ld.index}] at another index than the template computes it"
    return None


# ---------------------------------------------------------------- inlining

_FREE_OPS = ()  # ops a prologue may always hold (none: casts and index math are not ops)


def inline_ok(consumer, producer) -> bool:
    """May `producer` be recomputed in a matmul's operand? Only when (nearly) free: the operand is
    evaluated once per N tile (A) or M tile (B), inside the K loop."""
    if not is_matmul(consumer):
        return True
    return expr_op_count(producer.body) <= knobs.mm_prologue_max_ops


def is_view_or_cast(e) -> bool:
    """An expression of loads, casts and constants only."""
    if isinstance(e, (Load, Const, IndexValue)):
        return True
    if isinstance(e, Cast):
        return is_view_or_cast(e.arg)
    if isinstance(e, Op):
        return False
    return False
