"""All tunables in one place, read from the environment (AOTFUSE_*), overridable in a scope.

| knob | env | default | meaning |
|---|---|---|---|
| targets | AOTFUSE_TARGETS | sm_80,sm_90 | architectures to compile cubins for |
| compile_workers | AOTFUSE_COMPILE_WORKERS | cpu count | parallel cubin compiles |
| max_fusion_size | AOTFUSE_MAX_FUSION_SIZE | 64 | most loop-IR nodes in one kernel |
| max_pairs_per_buffer | AOTFUSE_MAX_PAIRS | 64 | cap on fusion candidates tried per shared buffer |
| fusion_fuel | AOTFUSE_FUSION_FUEL | -1 | stop fusing after N fusions (bisect a bad fusion); -1 = no cap |
| inline_max_ops | AOTFUSE_INLINE_MAX_OPS | 24 | a pointwise node is inlined into its consumers when its body has at most this many ops |
| persistent_rblock_max | AOTFUSE_PERSISTENT_RBLOCK | 4096 | largest reduction kept in registers (persistent); beyond it loops |
| persistent_tile | AOTFUSE_PERSISTENT_TILE | 4096 | persistent row reductions: elements per program (rows packed up to this many) |
| short_row_tile | AOTFUSE_SHORT_ROW_TILE | 1024 | persistent row reductions of at most 256 (padded) elements: elements per program, rows packed, one warp |
| persistent_warp_elems | AOTFUSE_PERSISTENT_WARP_ELEMS | 1024 | persistent row reductions: one warp per this many elements of the tile (1 to 8 warps): 32 per thread (H100, 2026-11-26, scripts/knob_ab.py: residual add + LayerNorm over 8192 x 768 bf16 19.6 -> 16.3 us at 4 warps instead of 8, LayerNorm fwd+bwd 43.9 -> 37.0; rows of 1000 and 4096 unchanged) |
| persistent_row_elems | AOTFUSE_PERSISTENT_EPT | 32 | rows held in registers beyond 4096 elements (when persistent_rblock_max allows): warps chosen so each thread holds about this many elements (8 to 32 warps) |
| split_min_programs | AOTFUSE_SPLIT_PROGRAMS | 264 | a reduction whose kernel would launch fewer programs (2 per SM of an H100) is split in two stages (schedule/split.py) |
| split_min_elems | AOTFUSE_SPLIT_ELEMS | 32768 | ... only when one of its programs would reduce at least this many elements (r; 64*r for a column tile) |
| split_min_chunk | AOTFUSE_SPLIT_CHUNK | 128 | ... into chunks of at least this many elements (the partial buffer is that much smaller than the input) |
| split_welford | AOTFUSE_SPLIT_WELFORD | 1 | a variance split with its mean (same chunks) takes per-chunk (sum, M2) partials in one pass, combined by Chan's formula (schedule/split_welford.py); 0: the variance's partials read the mean's final (two passes) |
| split_outer_programs | AOTFUSE_SPLIT_OUTER_PROGRAMS | 0 | column reductions (a bias or norm-weight gradient) are split into enough chunks for this many partial programs; 0: split_min_programs |
| outer_rblock | AOTFUSE_OUTER_RBLOCK | 128 | column reductions: most rows per loop step of a [64 x RBLOCK] tile, fewer while its accumulators would take more than 32 registers per thread (emit/space.block_choice) |
| outer_tile | AOTFUSE_OUTER_TILE | 4096 | column reductions: outputs per tile up to this many elements / RBLOCK (at least 64; what matters for short columns, r < outer_rblock, whose RBLOCK is small) |
| outer_persistent_r | AOTFUSE_OUTER_PERSISTENT_R | 1024 | column reductions with fewer than 8 programs' worth of outputs (a split reduction's final) hold columns of up to this many rows whole, in narrower tiles and more programs (emit/space._few_columns); 0: off |
| outer_stages | AOTFUSE_OUTER_STAGES | 0 | column reductions' loops over rows as `tl.range(..., num_stages=N)` (loop_stages for them); 0 or 1: plain `range` |
| mix_order | AOTFUSE_MIX_ORDER | 1 | a column reduction over the rows of a row reduction's input is split for, and fused into, one mix-order kernel (schedule/mix.py); 0: off |
| eviction_hints | AOTFUSE_EVICTION_HINTS | 1 | looped row kernels that read an input in two loops keep it in L2 for the second (evict_last) and stream the rest (evict_first); 0: no hints |
| mix_programs | AOTFUSE_MIX_PROGRAMS | 256 | mix-order kernels: S, the programs (chunks of rows), is the fewest power-of-two chunking with at least this many (schedule/mix.py condition 4) |
| mix_warps | AOTFUSE_MIX_WARPS | 0 | mix-order kernels: warps per program; 0: one per 1024 elements of a step (emit/mix_kernel.MIX_WARP_ELEMS), 1 to 8 |
| mix_stages | AOTFUSE_MIX_STAGES | 3 | the mix-order kernel's row loop as `tl.range(..., num_stages=N)`: Triton copies the next rows' loads into shared memory (cp.async) while this row computes; 0 or 1: plain `range`, one row in flight per program (H100, 2026-11-25, LayerNorm fwd+bwd 16384x4096: mix kernel 145 us plain, 145 at 2 stages, 110 at 3, 112 at 4) |
| welford_rblock | AOTFUSE_WELFORD_RBLOCK | 2048 | looped rows of at least 16384 elements whose kernel computes a Welford pair (mean and variance in one pass): elements per loop step, at 16 warps (H100, 2026-11-26, scripts/long_rows_probe.py: LayerNorm 1024 x 50257 bf16 177 us at 4096, 165 at 2048; torch.compile 188) |
| loop_stages | AOTFUSE_LOOP_STAGES | 0 | the same for looped reductions' loops over r; 0: plain `range` (H100, 2026-11-25, cross-entropy fwd+bwd 8192x32000: 575 us plain, 727 / 686 / 677 at 2 / 3 / 4 stages) |
| hoist_loads | AOTFUSE_HOIST_LOADS | columns | row reductions held in registers issue some loads at the top of the kernel, before the first reduction, so they are in flight with the rows: "columns" the per-column loads (a norm's weight and bias, [1, RBLOCK]; H100, 2026-11-26, scripts/odd_rows_probe.py --sweep: LayerNorm over 327680 x 197 bf16 104.6 -> 95.7 us, torch.compile 103.1); "all" every load of the tile's rows as well; "off" each load where its value is first needed |
| predicated_selects | AOTFUSE_PREDICATED_SELECTS | 1 | positional selects (a concatenation's sources) load each branch under its predicate with the clamps it decides dropped, so the loads vectorize (emit/predicate.py; H100, 2026-11-26, scripts/knob_ab.py anchor: the qkv-gradient cat 30.8 -> 24.3 us per call, 123 -> 97 us per step); 0: every branch loaded everywhere with clamped indices |
| mix_min_r | AOTFUSE_MIX_MIN_R | 2048 | mix-order only for rows of at least this many elements (H100: 8192 x 768 lost, 16384 x 4096 won; schedule/mix.py condition 2) |
| launch_overhead_us | AOTFUSE_LAUNCH_US | 4.0 | cost model: one kernel launch |
| bandwidth_gbs | AOTFUSE_BANDWIDTH_GBS | 2000 | cost model: device memory bandwidth |
| pdl | AOTFUSE_PDL | 0 | build: sm_90+ cubins wait for the kernel before them (griddepcontrol.wait, the body's first statement) and release the next one before their top-level stores (emit/pdl.py), so the runtime may launch them with programmatic dependent launch (program version 7); 0: plain kernels. Opt-in: H200, 2026-11-27, scripts/pdl_ab.py and `aotfuse bench --train`: the anchor GPT's inference at 8 x 1024 -2.0% and ResNet-18's at batch 1 -2.4%, but its training step +1.4% and its inference at 1 x 128 +1.1% |
| pdl_launch | AOTFUSE_PDL_LAUNCH | kernels | runtime: launch the binaries built with the PDL wait with CUDA's programmatic stream serialization (sm_90+), so each starts while the kernel before it drains: "kernels" where the program's previous GPU step is one of its kernels (after an extern, a plain launch), "all" everywhere, "off" nowhere (the wait then returns at once) |
| cuda_graphs | AOTFUSE_CUDA_GRAPHS | 1 | runtime: capture static-shape programs into a CUDA graph |
| graph_streams | AOTFUSE_GRAPH_STREAMS | 4 | runtime: caller streams with state of their own per program (arena; and a CUDA graph when on), LRU beyond |
| graph_instances | AOTFUSE_GRAPH_INSTANCES | 4 | runtime: CUDA graphs per program and caller stream (input addresses x output sets, runtime/graphs.py); beyond, a call runs without a graph |
| dynamic_variants | AOTFUSE_DYNAMIC_VARIANTS | 1 | build, dynamic dims: kernel variants per sub-range of a dynamic reduction length (emit/space.variant_blocks); 0: one kernel for the whole range |
| shape_cache | AOTFUSE_SHAPE_CACHE | 16 | runtime, archives with dynamic dims: shapes (tuples of dim values) kept linked per program, each with its executor (arena) and, on CUDA, its graphs; the least recently used shape beyond is released (runtime/shapes.py) |
| graph_copy_bytes | AOTFUSE_GRAPH_COPY_BYTES | 4096 | runtime: graph inputs of at most this many bytes are copied into static buffers and outputs cloned (not a training backward's gradients) (a loss kept by the caller pins no output set); larger ones are read and returned in place (runtime/graphs.py says which) |
| donate | AOTFUSE_DONATE | 1 | build, training: the backward program's buffers may lie in saved tensors after their last read (schedule/donors.py, schedule/hosts.py), which the runtime hands over when autograd frees them after the backward (not with retain_graph); 0: every buffer in the arena |
| donate_min_bytes | AOTFUSE_DONATE_MIN_BYTES | 1048576 | build: the smallest buffer placed in a donated saved tensor or an idle output (each is a view made per call; small ones barely move the peak) |
| output_hosts | AOTFUSE_OUTPUT_HOSTS | 1 | build: an output allocated on its own is allocated at the program's start and buffers that die before it is written lie in its bytes (schedule/hosts.py: inference's arena no longer held on top of the logits); 0: outputs allocated where they are written |
| debug | AOTFUSE_DEBUG | 0 | 1: CLI shows tracebacks |
| mm | AOTFUSE_MM | heavy | matmuls: `extern` (every matmul cuBLAS, a tanh GELU in cuBLASLt's epilogue, a residual add as cuBLASLt's C), `heavy` (as `extern`, except a matmul whose epilogue lowering found heavy, a tanh GELU or its backward (lower/epilogue.epilogue_region), is a Triton template when schedule/templates.py's cost model prefers it), `template` (every floating-point matmul a Triton template with its epilogue fused), `auto` (the cost model for every matmul). Default heavy: on an H100 (2026-11-27, scripts/knob_ab.py and scripts/zoo_gpu.py --variant, one process) the anchor GPT's training step 4674 -> 4598 us of kernels (5159 -> 5081 us per step), GPT-2 inference 4.76 -> 4.39 ms and training 18.18 -> 18.09, T5, Whisper, BERT, ViT, Llama unchanged (no heavy template, or within 1%); `auto` lost 1-5% on the training of Llama, ViT, T5 and Whisper (residual and prologue templates its estimates prefer). Each target compiles its own tiles (emit/mm_configs.target_configs); the choice is priced for the archive's newest target |
| attention | AOTFUSE_ATTENTION | auto | inference attention (scaled_dot_product_attention): `auto` a Triton flash-attention template (emit/template_attn.py) where it is supported and up to head dim 64 (H200, 2026-11-26, scripts/attn_probe.py: 0.58-0.93 of sdpa's time on the anchor GPT's shapes, 0.78-0.82 with a kept mask), except at most 512 keys over at least 4 x 132 row blocks without a per-head mask, where sdpa's cuDNN kernels were faster (H100, 2026-11-27: ViT-B/16 6.23 -> 5.99 ms, BERT-base 9.48 -> 9.35); `template` wherever supported, `extern` always torch's sdpa; schedule/attention.py lists what keeps sdpa |
| mm_tf32 | AOTFUSE_MM_TF32 | 0 | 1: fp32 template matmuls may use TF32 (eager's default is full fp32) |
| mm_tflops | AOTFUSE_MM_TFLOPS | 600 | cost model: cuBLAS half-precision matmul throughput (fp32: a tenth) |
| mm_template_efficiency | AOTFUSE_MM_TEMPLATE_EFF | 0.85 | cost model: a persistent (TMA) template's throughput as a fraction of cuBLAS's (H200, 2026-11-26: 0.86-0.88 on the anchor's K=768 matmuls at 8192 rows, about 1.0 at K=3072) |
| mm_ws_efficiency | AOTFUSE_MM_WS_EFF | 0.92 | cost model: the same for a warp-specialized persistent template (sm_90's large rule; H200, 2026-11-26, scripts/tune_mm.py at 8192 rows: qkv 0.90 of cuBLAS, head 0.99, proj about 1.0) |
| mm_bandwidth_gbs | AOTFUSE_MM_BANDWIDTH_GBS | 3000 | cost model: device memory bandwidth for a matmul epilogue's round trip (an H100's measured copy; an H200's is 4270) |
| mm_slow_op_us | AOTFUSE_MM_SLOW_OP_US | 2.9 | cost model: us per million output elements per slow op (lower/epilogue.SLOW_OPS: erf) in a template's epilogue, which runs while its tensor cores wait (H100, 2026-11-27: ViT's MLP dgrad with the erf GELU backward, 12608 x 3072 x 768, took 231 us as a template against 157 for cuBLAS and a separate kernel, some 110 us over the estimate) |
| mm_tile_efficiency | AOTFUSE_MM_TILE_EFF | 0.45 | cost model: the same for a template with one program per tile (pointer loads; H200, 2026-11-26, 1024 rows: 0.40-0.82 of cuBLAS) |
| mm_extern_us | AOTFUSE_MM_EXTERN_US | 5.0 | cost model: one library call's fixed cost |
| mm_config | AOTFUSE_MM_CONFIG | (table) | every template matmul takes this tile configuration, `BM,BN,BK,GROUP_M,WARPS,STAGES[,PERSISTENT[,WARP_SPEC]]` (PERSISTENT: programs per SM of a persistent kernel, 0 for one per tile; WARP_SPEC 1: its tile loop warp-specialized; clamped to the problem; scripts/tune_mm.py measures them); empty: emit/mm_configs.py's table |
| mm_tma | AOTFUSE_MM_TMA | 1 | a matmul template loads an operand that is one strided read (a weight, a contiguous activation) through a TMA tensor descriptor (sm_90; made in the kernel, in the launch's global scratch); 0: pointer loads |
| fast_tanh | AOTFUSE_FAST_TANH | 1 | a kernel (a matmul template's epilogue or a fused kernel) whose stored values are all half precision computes tanh as sign(x) (1 - 2 / (1 + e^(2abs(x)))) with ex2.approx and a fast divide (absolute error about 1e-7), a series below abs(x) = 1/8 (within 2 ulps), instead of libdevice's tanhf (emit/printer._TANH_FAST); 0: libdevice |
| mm_epilogue_max_ops | AOTFUSE_MM_EPILOGUE_OPS | 64 | most ops of the pointwise nodes fused into a matmul template's epilogue (a bias + tanh GELU is 10-14; the GELU backward with the GELU itself about 40) |
| mm_epilogue_split_ops | AOTFUSE_MM_EPILOGUE_SPLIT | 16 | a template epilogue of more ops runs in two column halves of the accumulator (fewer live registers), never warp-specialized: H100, 2026-11-27, `scripts/dgelu_probe.py`, the anchor MLP's dgrad (8192 x 3072 x 768) with the GELU backward storing g and dh: 128x256x64 tiles whole 725 us (spills), in halves 130 us, against 155 for cuBLAS and separate kernels; warp-specialized 1929 us |
| mm_epilogue_heavy_nodes | AOTFUSE_MM_EPILOGUE_HEAVY | 6 | lowering: a matmul whose epilogue region (lower/epilogue.epilogue_region) holds more pointwise FX nodes than this is costed and tiled as a heavy epilogue (mm_epilogue_split_ops' configuration: persistent, not warp-specialized) |
| mm_prologue_max_ops | AOTFUSE_MM_PROLOGUE_OPS | 0 | most ops of a producer inlined into a matmul operand (0: views and casts only) |
| mm_gelu | AOTFUSE_MM_GELU | 1 | inference, matmuls kept as cuBLAS: a tanh GELU whose only input is an addmm's result (through views) becomes one `aten._addmm_activation.out` extern, the GELU applied by cuBLASLt's GELU_BIAS epilogue (export/mm_gelu.py); 0: the addmm extern and a GELU kernel, as before |
| gelu_formula | AOTFUSE_GELU_FORMULA | 1 | inference: a tanh GELU written out as its formula (GPT-2's gelu_new: `0.5 * x * (1 + tanh(...))`, eight ops) becomes one `aten.gelu(approximate="tanh")` (export/gelu_formula.py: matched by evaluating the sub-graph), which export/mm_gelu.py can fuse into cuBLASLt's epilogue; 0: the ops as written |
| mm_residual | AOTFUSE_MM_RESIDUAL | 1 | matmuls kept as cuBLAS, inference and training: `x + mm(a, b)` or `x + addmm(bias, a, b)` (through reshapes) becomes one `aotfuse.mm_residual.out` extern, the residual added by cuBLASLt as C with beta 1, the bias in its BIAS epilogue (lower/residual.py); 0: the matmul and an add fused into its consumer, as before |
| mm_pad | AOTFUSE_MM_PAD | 1 | cuBLAS matmuls (2-D, half or fp32) whose result rows or operand leading dims are not 16-byte multiples (a vocabulary of 50257): the result is written into rows padded to 16 bytes and used as their slice (a model output comes back with that row stride, as torch.compile's padded matmuls do), an operand is copied into padded rows once (a producer fuses into the copy); cuBLAS otherwise runs an sm_75 `align1` kernel (GPT-2's LM head, H100: 6.6 ms against 0.9); 0: as they are |
| conv_bias_split | AOTFUSE_CONV_BIAS_SPLIT | 1 | a convolution with a bias calls cuDNN without it and adds the bias per channel in a pointwise node that fuses into the conv's consumer (torch adds it in a separate kernel: a read and a write of the whole output); 0: the bias passed to the call |
| conv_layout | AOTFUSE_CONV_LAYOUT | auto | inference of a model with fp16/bf16 convolutions and no channels-last value: `auto` stores the activations around its convolutions and their filters channels-last (lower/conv_layout.py; cuDNN then converts no operand; a GroupNorm's statistics walk their rows in storage order, schedule/reorder.py), `keep` leaves eager's layout. On an H100 (2026-11-27, `scripts/zoo_gpu.py --more --variant cl:conv_layout=auto`, bf16 at the zoo sizes) MobileNetV2 went 3.26 -> 1.60 ms and the diffusion UNet 1.48 -> 1.11 (torch.compile reduce-overhead 2.05 and 1.40), ResNet-18, HF ResNet-50, ConvNeXt and SegFormer unchanged |
| train_step | AOTFUSE_TRAIN_STEP | split | --train: `split` (forward and backward programs), `auto` (one fused step program when the loss is a scalar, else split; partition/step.py), `step` (fused, a scalar loss required). Default split: on an H100 (2026-11-23, scripts/step_ab.py) the fused step wins where a loss's forward and backward share a large input (LayerNorm fwd+bwd 16384x4096: 0.479 vs 0.804 ms; cross-entropy 8192x32000: 1.323 vs 1.685 ms) but not yet on the anchor GPT step (5.916 vs 5.737 ms) |
| partition_materialize | AOTFUSE_PARTITION_MATERIALIZE | 0 | --train: the min cut charges a recomputed value that a backward extern reads (a GELU output or a LayerNorm output feeding a weight-gradient matmul) the write it costs there, so at memory budget 1 such values are saved (more memory, less backward traffic; partition/mincut.py) |
| partition_view_copies | AOTFUSE_PARTITION_VIEW_COPIES | 1 | --train: the min cut may save a view the backward reads as a dense copy of it (1.5x its bytes: the copy's read and write in the forward), where keeping the view's base would hold more: Phi-3's fused QKV matmul output (72 MiB a layer) was kept for its value third alone (the query and key are saved rotated); 0: a view is never saved, its base is (partition/mincut.py) |
| backward_stages | AOTFUSE_BACKWARD_STAGES | 1 | --train split: cut the backward into up to this many programs (at most 7) that hand their gradients to autograd in turn, so DDP's all-reduce overlaps the rest of the backward (partition/stages.py) |
| cublaslt | AOTFUSE_CUBLASLT | 1 | runtime (CUDA): matmul externs as one prepared cublasLtMatmul call each (runtime/cublaslt.py); 0: through torch's bindings |
| cublaslt_workspace | AOTFUSE_CUBLASLT_WORKSPACE | 33554432 | runtime: most workspace bytes a cuBLASLt algorithm may use (one buffer per executor state, of the size its algorithms need) |
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


@dataclasses.dataclass
class Knobs:
    # Mutable on purpose: `override` swaps values for a scope (tests, CLI flags).
    targets: tuple[str, ...] = tuple(os.environ.get("AOTFUSE_TARGETS", "sm_80,sm_90").split(","))
    compile_workers: int = _env_int("AOTFUSE_COMPILE_WORKERS", os.cpu_count() or 1)
    max_fusion_size: int = _env_int("AOTFUSE_MAX_FUSION_SIZE", 64)
    max_pairs_per_buffer: int = _env_int("AOTFUSE_MAX_PAIRS", 64)
    fusion_fuel: int = _env_int("AOTFUSE_FUSION_FUEL", -1)
    inline_max_ops: int = _env_int("AOTFUSE_INLINE_MAX_OPS", 24)
    persistent_rblock_max: int = _env_int("AOTFUSE_PERSISTENT_RBLOCK", 4096)
    persistent_tile: int = _env_int("AOTFUSE_PERSISTENT_TILE", 4096)
    persistent_warp_elems: int = _env_int("AOTFUSE_PERSISTENT_WARP_ELEMS", 1024)
    short_row_tile: int = _env_int("AOTFUSE_SHORT_ROW_TILE", 1024)
    persistent_row_elems: int = _env_int("AOTFUSE_PERSISTENT_EPT", 32)
    split_min_programs: int = _env_int("AOTFUSE_SPLIT_PROGRAMS", 264)
    split_min_elems: int = _env_int("AOTFUSE_SPLIT_ELEMS", 32768)
    split_min_chunk: int = _env_int("AOTFUSE_SPLIT_CHUNK", 128)
    split_outer_programs: int = _env_int("AOTFUSE_SPLIT_OUTER_PROGRAMS", 0)
    split_welford: bool = bool(_env_int("AOTFUSE_SPLIT_WELFORD", 1))
    outer_rblock: int = _env_int("AOTFUSE_OUTER_RBLOCK", 128)
    outer_stages: int = _env_int("AOTFUSE_OUTER_STAGES", 0)
    outer_persistent_r: int = _env_int("AOTFUSE_OUTER_PERSISTENT_R", 1024)
    outer_tile: int = _env_int("AOTFUSE_OUTER_TILE", 4096)
    mix_order: bool = bool(_env_int("AOTFUSE_MIX_ORDER", 1))
    mix_min_r: int = _env_int("AOTFUSE_MIX_MIN_R", 2048)
    predicated_selects: bool = bool(_env_int("AOTFUSE_PREDICATED_SELECTS", 1))
    hoist_loads: str = os.environ.get("AOTFUSE_HOIST_LOADS", "columns") or "columns"
    mix_programs: int = _env_int("AOTFUSE_MIX_PROGRAMS", 256)
    mix_warps: int = _env_int("AOTFUSE_MIX_WARPS", 0)
    mix_stages: int = _env_int("AOTFUSE_MIX_STAGES", 3)
    loop_stages: int = _env_int("AOTFUSE_LOOP_STAGES", 0)
    welford_rblock: int = _env_int("AOTFUSE_WELFORD_RBLOCK", 2048)
    eviction_hints: bool = bool(_env_int("AOTFUSE_EVICTION_HINTS", 1))
    launch_overhead_us: float = _env_float("AOTFUSE_LAUNCH_US", 4.0)
    bandwidth_gbs: float = _env_float("AOTFUSE_BANDWIDTH_GBS", 2000.0)
    cuda_graphs: bool = bool(_env_int("AOTFUSE_CUDA_GRAPHS", 1))
    graph_streams: int = _env_int("AOTFUSE_GRAPH_STREAMS", 4)
    graph_instances: int = _env_int("AOTFUSE_GRAPH_INSTANCES", 4)
    graph_copy_bytes: int = _env_int("AOTFUSE_GRAPH_COPY_BYTES", 4096)
    donate: bool = bool(_env_int("AOTFUSE_DONATE", 1))
    donate_min_bytes: int = _env_int("AOTFUSE_DONATE_MIN_BYTES", 1 << 20)
    output_hosts: bool = bool(_env_int("AOTFUSE_OUTPUT_HOSTS", 1))
    dynamic_variants: bool = _env_int("AOTFUSE_DYNAMIC_VARIANTS", 1) != 0
    shape_cache: int = _env_int("AOTFUSE_SHAPE_CACHE", 16)
    debug: bool = bool(_env_int("AOTFUSE_DEBUG", 0))
    mm: str = os.environ.get("AOTFUSE_MM", "heavy") or "heavy"
    mm_tf32: bool = bool(_env_int("AOTFUSE_MM_TF32", 0))
    mm_tflops: float = _env_float("AOTFUSE_MM_TFLOPS", 600.0)
    mm_template_efficiency: float = _env_float("AOTFUSE_MM_TEMPLATE_EFF", 0.85)
    mm_ws_efficiency: float = _env_float("AOTFUSE_MM_WS_EFF", 0.92)
    mm_tile_efficiency: float = _env_float("AOTFUSE_MM_TILE_EFF", 0.45)
    mm_extern_us: float = _env_float("AOTFUSE_MM_EXTERN_US", 5.0)
    mm_bandwidth_gbs: float = _env_float("AOTFUSE_MM_BANDWIDTH_GBS", 3000.0)
    mm_slow_op_us: float = _env_float("AOTFUSE_MM_SLOW_OP_US", 2.9)
    mm_config: str = os.environ.get("AOTFUSE_MM_CONFIG", "")
    fast_tanh: bool = bool(_env_int("AOTFUSE_FAST_TANH", 1))
    mm_tma: bool = bool(_env_int("AOTFUSE_MM_TMA", 1))
    pdl: bool = bool(_env_int("AOTFUSE_PDL", 0))
    pdl_launch: str = os.environ.get("AOTFUSE_PDL_LAUNCH", "kernels") or "kernels"
    attention: str = os.environ.get("AOTFUSE_ATTENTION", "auto")
    mm_epilogue_max_ops: int = _env_int("AOTFUSE_MM_EPILOGUE_OPS", 64)
    mm_epilogue_split_ops: int = _env_int("AOTFUSE_MM_EPILOGUE_SPLIT", 16)
    mm_epilogue_heavy_nodes: int = _env_int("AOTFUSE_MM_EPILOGUE_HEAVY", 6)
    mm_prologue_max_ops: int = _env_int("AOTFUSE_MM_PROLOGUE_OPS", 0)
    mm_gelu: bool = bool(_env_int("AOTFUSE_MM_GELU", 1))
    gelu_formula: bool = bool(_env_int("AOTFUSE_GELU_FORMULA", 1))
    mm_residual: bool = bool(_env_int("AOTFUSE_MM_RESIDUAL", 1))
    mm_pad: bool = bool(_env_int("AOTFUSE_MM_PAD", 1))
    # a sort of int64 indices below 2**15 (an MoE's routed experts) runs on int16 keys (lower/extern._narrow_sort)
    narrow_sort: bool = bool(_env_int("AOTFUSE_NARROW_SORT", 1))
    conv_bias_split: bool = bool(_env_int("AOTFUSE_CONV_BIAS_SPLIT", 1))
    conv_layout: str = os.environ.get("AOTFUSE_CONV_LAYOUT", "auto") or "auto"
    train_step: str = os.environ.get("AOTFUSE_TRAIN_STEP", "split") or "split"
    backward_stages: int = _env_int("AOTFUSE_BACKWARD_STAGES", 1)
    partition_materialize: bool = bool(_env_int("AOTFUSE_PARTITION_MATERIALIZE", 0))
    partition_view_copies: bool = bool(_env_int("AOTFUSE_PARTITION_VIEW_COPIES", 1))
    cublaslt: bool = bool(_env_int("AOTFUSE_CUBLASLT", 1))
    cublaslt_workspace: int = _env_int("AOTFUSE_CUBLASLT_WORKSPACE", 32 * 1024 * 1024)


knobs = Knobs()


@contextlib.contextmanager
def override(**values) -> Iterator[Knobs]:
    """Temporarily set knobs: `with override(fusion_fuel=3): build(...)`."""
    old = {k: getattr(knobs, k) for k in values}
    for k, v in values.items():
        if not hasattr(knobs, k):
            raise AttributeError(f"no knob named {k!r}")
        setattr(knobs, k, v)
    try:
        yield knobs
    finally:
        for k, v in old.items():
            setattr(knobs, k, v)
