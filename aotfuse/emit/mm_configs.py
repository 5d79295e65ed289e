"""Tile configurations of the matmul template, chosen at build time without a GPU.

sm_90 with bf16/fp16 operands: rules fitted to measurements (`_hopper_half`). Otherwise a table keyed
by (target, operand dtype class, size class); no autotuning. Each target of an archive gets its own
configuration (`target_configs`): the tiles are literals in the kernel's source, so a template whose
targets differ is written once per distinct configuration and each target's cubin compiled from its own
source (emit/template_mm.py, KernelSource.per_target; the binary records its own grid and persistence).
The cost model prices the template for the archive's newest target (`pricing_target`: the one whose
parameters were measured, and the one an archive built for several is deployed on for speed). From a
table entry the tiles shrink while the grid would leave SMs idle (a small M x N), down to 16 (tl.dot's
least), and each block dimension is clamped to the next power of two of its extent (odd and tiny
sizes). Every choice comes with the reason, which the build report keeps.

Shared memory per config: (BM*BK + BK*BN) * itemsize * stages; sm_80 allows 163 KiB per block,
sm_90 227 KiB. The half-precision entries keep sm_80's under 100 KiB.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MMConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: int = 0  # N: a persistent kernel (N programs per SM loop over the tiles); 0: one program per tile
    # 1: the persistent tile loop warp-specialized (Triton's Hopper pass: a producer warpgroup issues the TMA
    # loads, two consumer warpgroups of num_warps each run the wgmma and the epilogue: 3 x num_warps warps)
    warp_spec: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def smem_bytes(self, itemsize: int) -> int:
        return (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize * self.num_stages


ARCH = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}
SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132}  # A100, A40/3090-class, L40/4090-class, H100

# (target, dtype class, size class) -> config. dtype class: "half" (bf16/fp16) or "fp32".
# size class: "large" (M >= 1024 and N >= 512), "medium" (M >= 256), "small" (otherwise).
_HALF = {
    "large": MMConfig(128, 128, 64, 8, 8, 3),
    "medium": MMConfig(64, 128, 64, 8, 4, 3),
    "small": MMConfig(64, 64, 64, 8, 4, 3),
}
_HALF_SM90 = {
    "large": MMConfig(128, 128, 64, 8, 8, 4),
    "medium": MMConfig(64, 128, 64, 8, 4, 4),
    "small": MMConfig(64, 64, 64, 8, 4, 4),
}
_FP32 = {
    "large": MMConfig(128, 64, 32, 8, 8, 3),
    "medium": MMConfig(64, 64, 32, 8, 4, 3),
    "small": MMConfig(32, 64, 32, 8, 4, 2),
}
TABLE: dict[tuple[str, str, str], MMConfig] = {}
for _t in ARCH:
    for _cls, _c in (_HALF_SM90 if ARCH[_t] >= 90 else _HALF).items():
        TABLE[_t, "half", _cls] = _c
    for _cls, _c in _FP32.items():
        TABLE[_t, "fp32", _cls] = _c


def dtype_class(dtype: str) -> str:
    return "fp32" if dtype == "float32" else "half"


def size_class(m: int, n: int) -> str:
    if m >= 1024 and n >= 512:
        return "large"
    if m >= 256:
        return "medium"
    return "small"


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _count(b: int, m: int, n: int, bm: int, bn: int) -> int:
    """Tiles of BM x BN over B x M x N."""
    return b * -(-m // bm) * -(-n // bn)


def tile_count(b: int, m: int, n: int, c: MMConfig) -> int:
    """Tiles of the config's BM x BN over B x M x N."""
    return _count(b, m, n, c.block_m, c.block_n)


def _clamp(v: int, extent: int) -> int:
    """A block never exceeds the next power of two of its extent; tl.dot needs 16."""
    return max(16, min(v, _pow2_at_least(extent)))


def _clamped(c: MMConfig, m: int, n: int, k: int) -> MMConfig:
    return dataclasses.replace(c, block_m=_clamp(c.block_m, m), block_n=_clamp(c.block_n, n),
                               block_k=_clamp(c.block_k, k))


def _hopper_half(b: int, m: int, n: int, k: int, sms: int, heavy: bool = False) -> tuple[MMConfig, str]:
    """sm_90, bf16/fp16 operands: rules fitted to scripts/tune_mm.py on an H200 (2026-11-26, the anchor
    GPT's matmuls with their epilogues at 8192 and 128 rows; docs/benchmarks.md).

    Large (at least 128 rows and one 128x128 tile per SM), unbatched: persistent (the runtime launches one
    program per SM; operands through TMA descriptors) and warp-specialized (a producer warpgroup, two
    consumer warpgroups of 4 warps), 128 x 256 x 64 tiles with 4 stages when N >= 4096, else 128 x 128 x 128
    with 3 stages (scripts/mm_gap_probe.py, H200 2026-11-26: best or within 2% of the best on the
    anchor's qkv, out, proj and head, at parity with cuBLAS on qkv and head). A heavy epilogue (a GELU or
    its backward) is never warp-specialized: 128 x 128 x 64, 8 warps, 3 stages, persistent with two
    programs per SM, so one's epilogue (in column halves) runs while the other's tensor cores work
    (scripts/dgelu_probe.py, H100 2026-11-27: the MLP's dgrad with the GELU backward about 107 us against
    115 for one program per SM at 128 x 256, 1929 warp-specialized, 130 for cuBLAS and a separate kernel;
    fc1 with the bias and GELU storing both 81-83 us against 96). Batched (no TMA): 128 x 256
    x 64 tiles, 8 warps, 3 stages when N >= 2048, else 128 x 128 x 64, 8 warps, 4 stages. Small: one program per tile with BM = 64 (a warpgroup's wgmma height); BN the largest of
    128, 64, 32, 16 that still gives at least half an SM's worth of programs per SM (tiles >= SMs / 2:
    the measured optimum was 72 to 128 tiles on 132 SMs); BK = 128 with 3 stages (4 when BN <= 32)
    for a narrow tile, 64 with 4 stages at BN = 128."""
    big = _count(b, m, n, 128, 128)
    if m >= 128 and big >= sms and b == 1 and heavy:
        c = MMConfig(128, _clamp(128, n), _clamp(64, k), 8, 8, 3, persistent=2)
        return c, (f"sm_90 large ({big} tiles of 128x128 >= {sms} SMs), a heavy epilogue: persistent, two programs "
                   f"per SM (one's epilogue runs while the other's tensor cores work), not warp-specialized, "
                   f"{c.block_m}x{c.block_n}x{c.block_k}")
    if m >= 128 and big >= sms and b == 1:
        wide = n >= 4096
        c = MMConfig(128, 256 if wide else 128, 64 if wide else 128, 8, 4, 4 if wide else 3, persistent=1,
                     warp_spec=1)
        c = dataclasses.replace(c, block_n=_clamp(c.block_n, n), block_k=_clamp(c.block_k, k))
        return c, (f"sm_90 large ({big} tiles of 128x128 >= {sms} SMs): persistent, warp-specialized, "
                   f"{c.block_m}x{c.block_n}x{c.block_k}" + (" (N >= 4096)" if wide else ""))
    if m >= 128 and big >= sms:
        wide = n >= 2048
        c = MMConfig(128, 256 if wide else 128, 64, 8, 8, 3 if wide else 4, persistent=1)
        c = dataclasses.replace(c, block_n=_clamp(c.block_n, n), block_k=_clamp(64, k))
        return c, (f"sm_90 large ({big} tiles of 128x128 >= {sms} SMs): persistent, "
                   f"{c.block_m}x{c.block_n}x{c.block_k}" + (" (N >= 2048)" if wide else ""))
    bm = _clamp(64, m)
    bn = _clamp(128, n)
    while bn > 16 and _count(b, m, n, bm, bn) < sms / 2:
        bn //= 2
    bk = 128 if bn <= 64 else 64
    stages = 4 if (bk == 64 or bn <= 32) else 3
    c = MMConfig(bm, bn, _clamp(bk, k), 8, 4, stages)
    return c, (f"sm_90 small: {c.block_m}x{c.block_n}x{c.block_k}, {tile_count(b, m, n, c)} programs "
               f"(BN halved from 128 while fewer than {sms} / 2)")


def parse_config(text: str) -> MMConfig:
    """`BM,BN,BK,GROUP_M,WARPS,STAGES` (the AOTFUSE_MM_CONFIG knob) -> MMConfig, checked."""
    from ..errors import BuildError

    remedy = ("write six integers BM,BN,BK,GROUP_M,WARPS,STAGES, e.g. 128,128,64,8,8,4, and optionally a 7th: "
              "N for a persistent kernel (N programs per SM), 0 for one program per tile, and an 8th: 1 to "
              "warp-specialize a persistent kernel")
    try:
        vals = [int(v) for v in text.replace("x", ",").split(",")]
    except ValueError:
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r} is not six integers", remedy=remedy) from None
    if len(vals) not in (6, 7, 8):
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r} has {len(vals)} values, not 6 to 8", remedy=remedy)
    c = MMConfig(*vals)
    for what, v in (("BM", c.block_m), ("BN", c.block_n), ("BK", c.block_k)):
        if v < 16 or v & (v - 1):
            raise BuildError(f"AOTFUSE_MM_CONFIG: {what}={v} is not a power of two >= 16 (tl.dot's least)",
                             remedy=remedy)
    if c.block_m > 256 or c.block_n > 256:
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r}: BM and BN at most 256 (a TMA box's side)", remedy=remedy)
    if c.num_warps not in (1, 2, 4, 8, 16) or c.group_m < 1 or c.num_stages < 1:
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r}: warps must be 1, 2, 4, 8 or 16, GROUP_M and STAGES >= 1",
                         remedy=remedy)
    if not 0 <= c.persistent <= 8:
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r}: the 7th value (programs per SM) must be 0 to 8", remedy=remedy)
    if c.warp_spec not in (0, 1) or (c.warp_spec and not c.persistent) or (c.warp_spec and 3 * c.num_warps > 32):
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r}: the 8th value (warp specialization) is 0 or 1, needs a "
                         "persistent kernel and at most 8 warps (three warpgroups of them)", remedy=remedy)
    if c.warp_spec and c.num_stages > 4:
        # H200, 2026-11-26 (scripts/tune_mm.py): Triton 3.6's Hopper warp specialization returned NaN at
        # 128x128x64 with 5 and 6 stages (correct at 3 and 4)
        raise BuildError(f"AOTFUSE_MM_CONFIG={text!r}: a warp-specialized kernel takes at most 4 stages (Triton "
                         "3.6 computed NaN with 5 and 6)", remedy=remedy)
    return c


def pricing_sms(targets) -> int:
    """The SMs of the pricing target (132, an H100's, when none is known)."""
    return SMS[pricing_target(targets)]


def known_targets(targets) -> list[str]:
    """The targets this module has rules for, in the given order (sm_90 when none is known)."""
    return [t for t in (tuple(targets or ()) or ("sm_90",)) if t in ARCH] or ["sm_90"]


def pricing_target(targets) -> str:
    """The target the cost model prices a template for: the newest of the archive's."""
    return max(known_targets(targets), key=ARCH.__getitem__)


def choose_config(b: int, m: int, n: int, k: int, dtype: str, targets, heavy_epilogue: bool = False
                  ) -> tuple[MMConfig, str]:
    """(config, why) the cost model prices: that of pricing_target(targets) (see target_configs)."""
    return config_for(b, m, n, k, dtype, pricing_target(targets), heavy_epilogue)


def target_configs(b: int, m: int, n: int, k: int, dtype: str, targets, heavy_epilogue: bool = False
                   ) -> list[tuple[str, MMConfig, str]]:
    """(target, config, why) for each known target, in the given order."""
    return [(t, *config_for(b, m, n, k, dtype, t, heavy_epilogue)) for t in known_targets(targets)]


def config_for(b: int, m: int, n: int, k: int, dtype: str, target: str, heavy_epilogue: bool = False
               ) -> tuple[MMConfig, str]:
    """(config, why) for a B x M x N x K matmul whose operands enter tl.dot as `dtype`, on `target`;
    `heavy_epilogue`: its epilogue holds many ops (lower/epilogue.epilogue_region), which rules out warp
    specialization."""
    from ..knobs import knobs

    if knobs.mm_config:
        c = parse_config(knobs.mm_config)
        if ARCH.get(target, 90) < 90 and c.persistent:
            # TMA and Hopper's warp specialization do not exist before sm_90: the same tiles, one per program
            c = dataclasses.replace(c, persistent=0, warp_spec=0)
        cc = _clamped(c, m, n, k)
        why = f"AOTFUSE_MM_CONFIG={knobs.mm_config}" + (" (one program per tile before sm_90)"
                                                       if c != parse_config(knobs.mm_config) else "")
        if cc != c:
            why += f"; clamped to the problem: {cc.block_m}x{cc.block_n}x{cc.block_k}"
        return cc, why
    cls, sc = dtype_class(dtype), size_class(m, n)
    sms = SMS.get(target, SMS["sm_90"])
    if ARCH.get(target, 90) >= 90 and cls == "half":
        return _hopper_half(b, m, n, k, sms, heavy_epilogue)
    c = TABLE[target, cls, sc]
    why = [f"table[{target}, {cls}, {sc}]"]
    cc = _clamped(c, m, n, k)
    if cc != c:
        why.append(f"clamped to the problem: {cc.block_m}x{cc.block_n}x{cc.block_k}")
        c = cc
    # Fill the SMs: halve the larger block while the grid has fewer programs than the target's SMs.
    shrunk = False
    while tile_count(b, m, n, c) < sms and max(c.block_m, c.block_n) > 32:
        if c.block_n >= c.block_m:
            c = dataclasses.replace(c, block_n=c.block_n // 2)
        else:
            c = dataclasses.replace(c, block_m=c.block_m // 2)
        shrunk = True
    if shrunk:
        why.append(f"shrunk to {c.block_m}x{c.block_n} for {tile_count(b, m, n, c)} programs (>= {sms} SMs if possible)")
    warps = 4 if c.block_m * c.block_n <= 64 * 128 else c.num_warps
    if warps != c.num_warps:
        c = dataclasses.replace(c, num_warps=warps)
    return c, "; ".join(why)
