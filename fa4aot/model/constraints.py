"""What FA4 (flash-attn-4 4.0.0b36) can run, per arch: pure functions, one rule each, stated once.

Used by the enumerator (what to build, what to report unsupported), the builder and the
runtime (what a call must satisfy). The numbers mirror `flash_attn/cute/interface.py` of the
pinned FA4; `tests/model/test_variants.py` checks the model built on them against FA4's own
compile keys.
"""

from __future__ import annotations

from typing import NamedTuple

from fa4aot.errors import NumSmsRequired

ARCHS = {"sm90": 90, "sm100": 100, "sm103": 103}
# SM count a build targets unless told otherwise: H100/H200 SXM, B200. sm103 (B300/GB300) has
# none: its SKUs report different counts (GPUS), and a persistent-scheduler grid sized for the
# wrong count is baked into the kernel. `--num-sms` or `--gpu` is required for sm103.
DEFAULT_NUM_SMS = {"sm90": 132, "sm100": 148}
# The SM count each datacenter GPU reports (torch's multi_processor_count), for `--gpu NAME`.
# NVIDIA's own material gives only full dies (Blackwell Ultra: 160 SMs, "Inside NVIDIA
# Blackwell Ultra", developer.nvidia.com, 2025); the shipping Blackwell SKUs' counts are users'
# measurements, consistent across projects (docs/blackwell.md cites them): B200 and HGX/DGX B300
# report 148, the Grace superchips GB200 and GB300 report 152. Hopper ("NVIDIA Hopper
# Architecture In-Depth", developer.nvidia.com): H100 SXM5 132 SMs, H100 PCIe 114.
GPUS = {
    "h100": ("sm90", 132),
    "h100-pcie": ("sm90", 114),
    "h200": ("sm90", 132),
    "b200": ("sm100", 148),
    "gb200": ("sm100", 152),
    "b300": ("sm103", 148),
    "gb300": ("sm103", 152),
}
# HBM peaks (bytes/s) of the sm90 cards, for `fa4aot explain --gpu` (split.model_for: the split
# plans' cost model) and the runtime where torch reports no memory clock (runtime.plan.hbm_peak)
GPU_HBM = {"h100": 3.35e12, "h100-pcie": 2.0e12, "h200": 4.8e12}
# The cubin each arch's kernels are compiled to (CUTE_DSL_ARCH). Arch-specific ("a") targets:
# tcgen05/TMEM (sm100) and wgmma (sm90) exist only there, and an "a" cubin loads only on its exact
# compute capability (CUDA Programming Guide, "Feature Set Compiler Targets"): an sm_100a
# artifact does not load on a B300 (10.3), so sm103 is its own target, store and fingerprint.
# FA4 also compiles a different kernel for 10.3 (no ex2 emulation, ld.red row max:
# flash_fwd_sm100.py `is_sm103`), so an sm_100f build would not be the B300 kernel either.
CUBIN_TARGETS = {"sm90": "sm_90a", "sm100": "sm_100a", "sm103": "sm_103a"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Runtime support: the archs whose kernels the runtime calls (FA4's argument lists per arch:
# fa4aot/runtime/abi.py; sm100/sm103 proven equal to FA4's on the CPU, tests/runtime/test_runtime_sm100.py).
RUNTIME_ARCHS = ("sm90", "sm100", "sm103")
# The archs whose kernels have run on a GPU through fa4aot (the rest: built, checked on the CPU
# and called through the CPU-proven ABI, never run: `not_run_note`).
GPU_RUN_ARCHS = ("sm90",)


class Tile(NamedTuple):
    m: int
    n: int


def arch_number(arch: str) -> int:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    return ARCHS[arch]


def is_blackwell(arch: str) -> bool:
    """Datacenter Blackwell (compute capability 10.x: B200/GB200 sm100, B300/GB300 sm103): the
    arch family FA4 runs its sm100 kernels on (`arch // 10 in [10, 11]`, FP8 `arch // 10 == 10`)."""
    return ARCHS.get(arch, 0) // 10 == 10


def cubin_target(arch: str) -> str:
    """The SM target FA4's cubins are compiled to for `arch` (what CUTE_DSL_ARCH is set to, and
    what the CPU check of every artifact's embedded cubin expects)."""
    arch_number(arch)
    return CUBIN_TARGETS[arch]


def default_num_sms(arch: str) -> int:
    """The SM count a build for `arch` targets when `--num-sms` is not given.

    Raises NumSmsRequired for sm103: see DEFAULT_NUM_SMS."""

    arch_number(arch)
    if arch not in DEFAULT_NUM_SMS:
        skus = ", ".join(f"{g.upper()} {n}" for g, (a, n) in GPUS.items() if a == arch)
        raise NumSmsRequired(
            f"{arch} has no default SM count: its GPUs report different ones ({skus}), and a "
            "wrong count is baked into the persistent kernels' grids. Name the GPU ("
            + " or ".join(f"--gpu {g}" for g, (a, _) in GPUS.items() if a == arch)
            + ") or pass the count read on it (torch.cuda.get_device_properties(0)."
            f"multi_processor_count): fa4aot build --arch {arch} --num-sms N"
        )
    return DEFAULT_NUM_SMS[arch]


def unsupported_reason(
    arch: str, dtype: str, head_dim: int, head_dim_v: int, *, qhead_per_kvhead: int = 1,
    fa4: str = "upstream",
) -> str | None:
    """Why FA4 cannot run this forward configuration on `arch`, or None if it can. fa4: the FA4
    source's ABI (model/abis.py): vLLM's copy runs head dims to 512 on sm90."""
    if arch not in ARCHS:
        return f"unknown arch {arch!r} (known: {', '.join(ARCHS)})"
    if dtype not in DTYPE_BYTES:
        return f"dtype {dtype} is not supported (bfloat16, float16; fp8 on sm100 only)"
    if dtype.startswith("float8") and not is_blackwell(arch):
        return feature_unsupported_reason(arch, "fp8")
    align = 16 // DTYPE_BYTES[dtype]
    if head_dim % align or head_dim_v % align:
        return f"head dims must be multiples of {align} for {dtype} (got {head_dim}, {head_dim_v})"
    if qhead_per_kvhead < 1:
        return "num_q_heads must be a positive multiple of num_kv_heads"
    if arch == "sm90":
        top = 512 if fa4 == "vllm" else 256
        if not (8 <= head_dim <= top and 8 <= head_dim_v <= top):
            if fa4 == "upstream" and max(head_dim, head_dim_v) <= 512:
                return (
                    f"head_dim {head_dim}/{head_dim_v} is out of range on sm90: upstream FA4 "
                    "supports 8..256 (MLA's head_dim_v 512 runs on sm100 only); vLLM's FA4 copy "
                    "runs head dims to 512 on sm90: build from it with `fa4aot build --fa4 "
                    "vllm`, or serve these layers with another backend (FlashInfer, cuDNN SDPA)"
                )
            return (
                f"head_dim {head_dim}/{head_dim_v} is out of range on sm90: upstream FA4 supports "
                "8..256 (hd512 and MLA kernels are sm100-only); serve these layers with another "
                "backend on sm90 (FlashInfer, cuDNN SDPA) or on sm100"
            )
    else:
        standard = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
        special = (head_dim, head_dim_v) in ((192, 128), (256, 256))
        if not (standard or special):
            # Found cross-compiling Gemma-4's full layers: FA4's sm100 forward asserts that
            # hd512 fits tensor memory (it does not); hdv 512 exists only as MLA (qv, hd 64).
            return (
                f"head_dim {head_dim}/{head_dim_v} is not supported on {arch}: 8..128, "
                "(192, 128) or (256, 256); head_dim_v 512 only as MLA (qv with head_dim 64: "
                "pass qv); the dense hd512 forward does not fit tensor memory"
            )
    return None


# Forward features upstream FA4 (4.0.0b36) implements only on sm100: the alternative to name.
SM100_ONLY_FEATURES = {
    "fp8": "FP8 (e4m3/e5m2) Q/K/V; upstream FA4 has no FP8 path on sm90. Alternatives: vLLM's "
    "FlashAttention fork (vllm.vllm_flash_attn: FA3's FP8 kernels with descales), FlashInfer's "
    "FP8 KV-cache attention, FA4 on sm100 (B200/GB200), or a bfloat16/float16 KV cache",
    "mla": "MLA absorbed attention (head_dim_v 512, qv); on sm90 use FlashMLA or FlashInfer's MLA",
    "split_kv": "split-KV (num_splits > 1); on sm90 FA4 runs num_splits=1 and fa4aot builds that",
}


FP8_KV = "float8_e4m3fn"


def fp8_kv_applies(head_dim: int) -> bool:
    """Whether a layer's FP8 KV cache is read by FA4 at all: vLLM runs FA4 on sm90 for head
    dims over 256 (FA3 serves the others, FP8 caches included), so only those layers get
    FP8-KV dequant kernels, and only theirs are reported when none can be built."""
    return head_dim > 256


def kv_dtype_reason(arch: str, fa4: str, dtype: str, kv_dtype: str, head_dim: int,
                    head_dim_v: int) -> str | None:
    """Why K/V of `kv_dtype` under a `dtype` Q (FP8-KV dequant) cannot be built, or None.
    Only vLLM's FA4 copy has that kernel (its `fp8_kv_dequant`): sm90, bf16/fp16 Q, e4m3 K/V,
    head_dim == head_dim_v, paged at page == tile_n (the enumeration's part)."""
    if kv_dtype != FP8_KV:
        return f"KV cache dtype {kv_dtype}: FP8-KV dequant takes {FP8_KV} only"
    if arch != "sm90":
        return f"FP8-KV dequant is sm90-only in vLLM's FA4 copy (not {arch})"
    if not fp8_kv_applies(head_dim):
        # vLLM runs FA4 on sm90 for head dims over 256 only (FA3 serves the rest, FP8 too)
        return (f"FP8-KV dequant is built where vLLM runs it: head dims over 256 (vLLM serves "
                f"hd{head_dim} with FA3 on sm90)")
    if fa4 != "vllm":
        return ("FP8-KV dequant (bf16/fp16 Q, e4m3 paged K/V with descales) exists only in "
                "vLLM's FA4 copy on sm90: build from it with `fa4aot build --fa4 vllm`")
    if dtype not in ("bfloat16", "float16") or head_dim != head_dim_v:
        return (f"FP8-KV dequant needs a bf16/fp16 Q and head_dim == head_dim_v (got {dtype}, "
                f"{head_dim}/{head_dim_v})")
    return None


def feature_unsupported_reason(arch: str, feature: str) -> str | None:
    if feature in SM100_ONLY_FEATURES and not is_blackwell(arch):
        return f"{feature} is sm100-only in upstream FA4: {SM100_ONLY_FEATURES[feature]}"
    return None


def mla_reason(arch: str) -> str | None:
    """Why no absorbed-MLA (qv) kernel runs on `arch` (FA4's MLA kernels are Blackwell-only), or
    None on Blackwell, where `fa4aot build` stores them and the runtime serves them."""
    return feature_unsupported_reason(arch, "mla")


# -- absorbed MLA (qv) on Blackwell: FA4's route between its three MLA forward kernels ----------

# FA4 4.0.0b36 (interface.py `_mla_1cta_route`, `_mla_fwd_plan`): a dense bf16/fp16 MLA call with
# num_splits == 1 runs the 2CTA kernel, or the 1CTA one on decode shapes (seqlen_q x heads per
# latent head <= 64) past one wave of 2CTA clusters (2 x batch x kv heads > SMs); 1CTA runs the
# 64-key-block mainloop (kb64: 64 x 64 tiles, one Q stage) at 64 heads or at seqlen_q 1.
MLA_ROUTES = ("2cta", "1cta", "1cta-kb64")
MLA_DECODE_ROWS = 64
# flash_fwd_mla_sm100.py 211-215 (Python reports line 214): the 2CTA kernel's 128-row cluster
# tile packs whole KV groups
MLA_2CTA_REFUSAL = (
    "AssertionError at flash_fwd_mla_sm100.py:214: assert (pack_gqa is False or "
    "self.cluster_tile_m % qhead_per_kvhead == 0 or qhead_per_kvhead % self.cluster_tile_m "
    "== 0) (FA4's 2CTA MLA kernel: the head ratio must divide its 128-row cluster tile)"
)


def mla_route(ratio: int, max_seqlen_q: int | None, batch: int, num_sms: int) -> str:
    """The MLA kernel FA4 runs a call on (one latent KV head, packed q; max_seqlen_q: the query
    length FA4 routes by, its host hint or else total_q (compile_keys.mla_features); None: unknown,
    counted as prefill)."""
    if max_seqlen_q is None or max_seqlen_q * ratio > MLA_DECODE_ROWS or 2 * batch <= num_sms:
        return "2cta"
    return "1cta-kb64" if ratio <= 64 and (ratio == 64 or max_seqlen_q == 1) else "1cta"


def mla_refusal(route: str, ratio: int) -> str | None:
    """FA4's own refusal of an MLA call on `route` (its kernel's assertion), or None."""
    if ratio > 128:
        return "AssertionError: FA4's MLA kernels take at most 128 query heads per latent head"
    if route == "2cta" and 128 % ratio:
        return MLA_2CTA_REFUSAL
    return None


def mla_tile(route: str) -> Tile:
    return Tile(64, 64) if route == "1cta-kb64" else Tile(128, 128)


def mla_paged_tma(route: str, page_size: int) -> bool:
    """kb64 loads any multiple of 64 by TMA (interface.py 1414); the others page == tile_n."""
    return page_size % 64 == 0 if route == "1cta-kb64" else page_size == 128


def fp8_reason(arch: str, dtype: str, which: str = "q/k/v") -> str:
    """Why an FP8 tensor cannot run on `arch` (the runtime's check of an FP8 KV cache: FA4's
    sm90 forward asserts "FP8 is only supported on SM100" only after its own checks, and a bf16
    q with an FP8 K/V used to be refused as a plain dtype mismatch, naming no way out)."""
    return f"{which} dtype {dtype} on {arch}: " + (
        feature_unsupported_reason(arch, "fp8") or "FP8 runs on sm100 only in fa4aot"
    )


def not_run_note(arch: str) -> str | None:
    """What `doctor`, `coverage` and the docs say of an arch's artifacts that have not run on a
    GPU here (None for sm90): the runtime serves them, but they are only compiled and checked
    on the CPU."""
    if arch in GPU_RUN_ARCHS:
        return None
    return (
        f"{arch} artifacts are built and checked but not run: cross-compiled with no GPU, their "
        "cubin target and FA4 compile keys checked on the CPU, and the runtime's argument "
        f"lists proven equal to FA4's on the CPU, but no {arch} kernel has run on a GPU through "
        "fa4aot (docs/blackwell.md)"
    )


def runtime_unsupported_reason(arch: str) -> str | None:
    if arch not in RUNTIME_ARCHS:
        return (
            f"the fa4aot runtime serves {', '.join(RUNTIME_ARCHS)} only; {arch} artifacts can be "
            "built but not called (no FA4 argument list is described for them: fa4aot/runtime/abi.py)"
        )
    return None


def fwd_tile(arch: str, head_dim: int, head_dim_v: int, causal: bool, local: bool) -> Tile:
    """The forward kernel's (tile_m, tile_n): FA4's `_tile_size_fwd_sm90` (dense, no sparsity);
    on Blackwell `_get_fwd_config`'s 128 x 128 at every head dim (a split with unequal head
    dims re-tiles to 64: not built, native_split_reason)."""
    if arch != "sm90":
        return Tile(128, 128)
    if head_dim <= 64:
        return Tile(192, 128)
    if head_dim <= 96:
        return Tile(192, 128 if (causal or local) else 144)
    if head_dim <= 128:
        return Tile(128, 128)
    if head_dim <= 192:
        return Tile(128, 96 if local else (128 if head_dim_v <= 128 else 112))
    if head_dim <= 256:
        return Tile(128, 64 if local else 80)
    return Tile(64, 64)  # head dims to 512: vLLM's FA4 copy only (upstream stops at 256)


def split_tile_m(arch: str, head_dim: int, head_dim_v: int) -> int | None:
    """The M tile of the sm90 split-KV chunk kernel (split.py), where it is not FA4's default:
    64 for head dims up to 128 (FA4's `tile_mn`, which its public entry points do not expose).
    A chunk's rows are one decode row's query heads of a KV head (4 at 32:8): a 128-row tile
    spends half its MMA work on rows that are not there (same bits, faster: docs/design.md,
    Tuned thresholds). None: FA4's tile (Blackwell splits with FA4's own kernels; head dims
    over 128 are not measured)."""
    if arch == "sm90" and max(head_dim, head_dim_v) <= 128:
        return 64
    return None


def small_m_tile(arch: str, head_dim: int, head_dim_v: int, rows: int) -> int | None:
    """The M tile of a twin that fa4aot builds beside an sm90 forward whose query rows (query
    length x heads per KV head, packed) fit split_tile_m's 64-row tile: FA4's 128- or 192-row
    tile spends most of its MMA work on rows that are not there (same bits, less GPU time:
    docs/design.md, Tuned thresholds). None: FA4's tile only."""
    tile = split_tile_m(arch, head_dim, head_dim_v)
    return tile if tile is not None and 0 < rows <= tile else None


class WideFold(NamedTuple):
    """A decode fold's kernel for a chip full of CTAs (forwards.trace_wide_fold, a split chunk
    kernel's part `part`): the chunk kernel with N tiles of tile_n keys, launched ctas_per_sm
    CTAs per SM (its two warpgroups' registers split mma_regs / producer_regs by setmaxnreg,
    within 65536 / ctas_per_sm per CTA). `paged`: built (and served) for a paged K too.
    `chunk_modes`: compiled through the split's chunk modes (forwards.trace_chunk_modes), the
    chunk kernel's ABI, to run a split step's chunks (WIDE_SPLIT); else FA4's ABI, the fold's.

    `fwd_wide` (WIDE_FOLD, two CTAs per SM: one CTA's prologue and epilogue overlap another's
    streaming). `fwd_wide1` (WIDE_FOLD_1, the same 64-key tiles at one CTA per SM, 240
    registers, packed K only: slower than fwd_wide paged, so not built paged) streams long
    contexts faster where its waves are full. fold_kernel chooses between them; the
    measurements are in docs/design.md, Tuned thresholds."""

    tile_n: int = 64
    ctas_per_sm: int = 2
    mma_regs: int = 232
    producer_regs: int = 24
    part: str = "fwd_wide"
    paged: bool = True
    chunk_modes: bool = False


WIDE_FOLD = WideFold()
WIDE_FOLD_1 = WideFold(ctas_per_sm=1, mma_regs=240, producer_regs=24, part="fwd_wide1",
                       paged=False)
WIDE_FOLDS = (WIDE_FOLD, WIDE_FOLD_1)


def wide_folds(
    arch: str, head_dim: int, head_dim_v: int, tile_m: int | None, paged: bool
) -> tuple[WideFold, ...]:
    """The wide fold kernels fa4aot builds beside a split chunk kernel of M tile `tile_m` (a
    variant's; None: FA4's) for a paged or packed K: on the 64-row chunk kernel (split_tile_m:
    sm90, head dims up to 128, one MMA warpgroup), WIDE_FOLDS that serve its K; else none."""
    if tile_m == 64 and split_tile_m(arch, head_dim, head_dim_v) == 64:
        return tuple(w for w in WIDE_FOLDS if w.paged or not paged)
    return ()


# A packed (dense or varlen) K's long one-row steps that the plan runs unsplit, as the fold, run
# instead as chunks on the wide fold kernel compiled through the chunk modes (part
# `fwd_wide_split`: forwards.trace_wide_fold; split.wide_split says when).
WIDE_SPLIT = WideFold(part="fwd_wide_split", paged=False, chunk_modes=True)
# The same for a paged K (FA4's cp.async paged path, which takes any page size, as the paged
# fwd_wide does; split.wide_split says when by the chunk kernel's path).
WIDE_SPLIT_PAGED = WIDE_SPLIT._replace(paged=True)


def wide_split(arch: str, head_dim: int, head_dim_v: int, tile_m: int | None,
               paged: bool) -> WideFold | None:
    """The wide split kernel fa4aot builds beside a split chunk kernel (WIDE_SPLIT, or for a
    paged K WIDE_SPLIT_PAGED), None where none is: on the 64-row chunk kernel (split_tile_m) of
    a packed K, whose artifact also serves dense K (the runtime views a dense K as packed), or
    of a paged one. Only the unsplit fold goes wide (split.wide_split): the split plan's own
    gains did not hold with the store's kernel (docs/design.md, Tuned thresholds). Head dim 128
    only: the one measured and checked on the GPU (tests/test_gpu_split.py)."""
    if (tile_m == 64 and (head_dim, head_dim_v) == (128, 128)
            and split_tile_m(arch, head_dim, head_dim_v) == 64):
        return WIDE_SPLIT_PAGED if paged else WIDE_SPLIT
    return None


# the page size a paged split chunk kernel's part `fwd_tma` serves (forwards.trace_tma_page)
TMA_PAGE = 64


def tma_page(arch: str, tile_m: int | None, paged: bool, paged_tma: bool | None) -> int | None:
    """The page size whose split steps run on the part `fwd_tma` beside a paged split chunk
    kernel (forwards.trace_tma_page), None where none is built: on the 64-row chunk kernel
    (split_tile_m) of FA4's cp.async paged path (the one kernel that serves every page size but
    its tile's), pages of TMA_PAGE keys get FA4's TMA paged path with TMA_PAGE-key tiles (FA4
    takes TMA only where a page is one tile). Values as the cp.async kernel's, keys reduced in
    other blocks (not bit-identical to the dense step). Split steps only: the decode fold on it
    ran slower, so the fold stays on the chunk kernel (docs/design.md, Tuned thresholds)."""
    if arch == "sm90" and tile_m == 64 and paged and not paged_tma:
        return TMA_PAGE
    return None


# keys (the plan's bucket, split.plan_bucket) from which a packed K's fold prefers fwd_wide1:
# below it fwd_wide's two CTAs per SM hide the prologues (docs/design.md, Tuned thresholds)
WIDE1_MIN_KEYS = 8192


def _tail_full(ctas: int, slots: int) -> bool:
    """Whether the last wave of `ctas` CTAs over `slots` concurrent ones is full or at least 60%
    full (the CTAs of a thin last wave each stream at one CTA's rate, well under the chip's)."""
    tail = ctas % slots
    return tail == 0 or tail * 10 >= slots * 6


def fold_kernel(ctas: int, num_sms: int, paged: bool, seqlen_k: int) -> str | None:
    """The part a decode step's fold of `ctas` (sequence, KV head) CTAs over `seqlen_k` keys
    runs on (None: the chunk kernel itself, 128-key tiles at one CTA per SM; WideFold), by how
    the CTAs fill the chip's waves (docs/design.md, Tuned thresholds):
    - one wave at one CTA per SM: the chunk kernel;
    - a packed K whose last wave at one CTA per SM is >= 60% full, over >= WIDE1_MIN_KEYS keys:
      fwd_wide1;
    - else fwd_wide where its waves of two CTAs per SM are one, or the last one >= 60% full
      (every SM busy where the chunk kernel leaves a thin second wave);
    - else the chunk kernel (a thin last wave in either wide kernel)."""
    if ctas <= num_sms:
        return None
    if not paged and seqlen_k >= WIDE1_MIN_KEYS and _tail_full(ctas, num_sms):
        return WIDE_FOLD_1.part
    if ctas <= 2 * num_sms or _tail_full(ctas, 2 * num_sms):
        return WIDE_FOLD.part
    return None


def fold_part(ctas: int, num_sms: int, paged: bool, seqlen_k: int, parts) -> str | None:
    """fold_kernel's part among the chunk kernel's `parts` (names), None for the chunk kernel:
    a store built before `fwd_wide1` chooses as for a paged K (fwd_wide or the chunk kernel)."""
    part = fold_kernel(ctas, num_sms, paged, seqlen_k)
    if part == WIDE_FOLD_1.part and part not in parts:
        part = fold_kernel(ctas, num_sms, True, seqlen_k)
    return part if part in parts else None


MERGE_MAX_THREADS = 256
# the version of fa4aot's merge kernel (kernels.MERGE_KEY; a split chunk kernel's artifact
# records it as parts.merge.version, and `fa4aot build` replaces one built with an older
# merge: build.superseded). 2: launched as a programmatic dependent launch, so it launches
# while the chunk kernel drains and waits in griddepcontrol.wait
MERGE_VERSION = 2
# the version of the ragged step's metadata kernel and merge (kernels.trace_ragged; recorded
# as parts.ragged_meta.version: build.superseded replaces an artifact with another); from 2 a
# packed K's artifact also holds parts fwd_used and ragged_meta_used (seqused_k)
RAGGED_VERSION = 2


def merge_threads(head_dim_v: int, max_splits: int) -> int | None:
    """Threads per CTA of fa4aot's split-KV merge kernel (kernels.trace_merge): one CTA per
    output row, each thread 8 columns (one 16-byte load of 2-byte partials) of every
    `groups`-th chunk, so the threads are (dv / 8) lanes x groups, a whole number of warps, at
    most MERGE_MAX_THREADS and at least one per chunk (each reads one chunk's LSE). None where
    no such count exists: FA4's combine kernel merges those chunks instead."""
    if head_dim_v % 8:
        return None
    lanes = head_dim_v // 8
    for groups in range(MERGE_MAX_THREADS // lanes, 0, -1):
        threads = lanes * groups
        if threads % 32 == 0 and threads >= max_splits:
            return threads
    return None


def paged_tma(arch: str, page_size: int, tile: Tile) -> bool:
    """FA4 takes the TMA paged-KV path iff the page size equals the kernel's tile_n.

    This is a correctness contract: a kernel compiled for the TMA path returns wrong numbers,
    with no error, for any other page size (rel. error 0.74 at page 64 for a page-128 kernel).
    """
    return page_size == tile.n


def resolve_window(
    causal: bool, window_left: int | None, window_right: int | None
) -> tuple[bool, bool, int | None, int | None]:
    """FA4's `_resolve_causal_local_window`: -> (causal, local, window_left, window_right)."""
    if (
        window_left is not None
        and window_right is not None
        and window_left < 0
        and window_right < 0
    ):
        window_left = window_right = None
    if causal:
        window_right = 0
    if window_left is not None or window_right is not None:
        if window_left is None and window_right == 0:
            return True, False, None, None
        return False, True, window_left, window_right
    return causal, False, window_left, window_right


# -- Blackwell split-KV (FA4's native num_splits) -----------------------------------------------

# FA4 4.0.0b36 `interface.S_PING_PONG_MIN_N_BLOCKS_PER_SPLIT`: a split kernel takes the S
# ping-pong path (a different kernel: `use_s_ping_pong` is in the compile key) only when each
# split holds at least this many key blocks; other head dims never do when split.
S_PING_PONG_MIN_BLOCKS_PER_SPLIT = {64: 16, 128: 64}
# FA4's split heuristic caps num_splits at 128 (`num_splits_heuristic(..., 128)`); the combine
# kernel fa4aot builds beside a split kernel takes that many partials (log2: 7).
MAX_NATIVE_SPLITS = 128


def native_num_splits(
    arch: str,
    *,
    batch: int,
    num_heads_kv: int,
    qhead_per_kvhead: int,
    seqlen_q: int,
    max_seqlen_k: int,
    head_dim: int,
    num_sms: int,
    pack_gqa: bool | None = None,
) -> int:
    """The split count FA4's heuristic picks for a call on Blackwell (`num_splits=0`:
    interface._get_fwd_config + num_splits_heuristic, 4.0.0b36), non-local, equal head dims: the
    SMs over the call's M tiles, capped at 128 and at the key blocks; 1 when there are at most
    4 key blocks. What the runtime would pass as num_splits (and, with max_seqlen_k,
    split_s_ping_pong then says which split kernel)."""
    pack = qhead_per_kvhead > 1 if pack_gqa is None else pack_gqa
    tile = fwd_tile(arch, head_dim, head_dim, False, False)
    rows = seqlen_q * (qhead_per_kvhead if pack else 1)
    m_tiles = -(-rows // (q_stage(arch, rows, tile, head_dim) * tile.m))
    total = batch * num_heads_kv * (1 if pack else qhead_per_kvhead) * m_tiles
    n_blocks = -(-max_seqlen_k // tile.n)
    if n_blocks <= 4 or total == 0:
        return 1
    return max(1, min(num_sms // total, MAX_NATIVE_SPLITS, n_blocks))


def native_split_reason(arch: str, head_dim: int, head_dim_v: int) -> str | None:
    """Why FA4's own split-KV (num_splits > 1) is not built for this layer on `arch`, or None."""
    if not is_blackwell(arch):
        return feature_unsupported_reason(arch, "split_kv")
    if head_dim != head_dim_v:
        # interface._get_fwd_config: fp32 partials overflow shared memory at (192, 128), so FA4
        # re-tiles (tile_n 64) or silently falls back to num_splits = 1 depending on the length
        return (
            f"FA4 changes the tile (or drops the split) for head dims {head_dim}/{head_dim_v} "
            "when splitting; fa4aot builds native split-KV for equal head dims only"
        )
    return None


def q_stage(arch: str, rows: int, tile: Tile, head_dim_v: int) -> int:
    """FA4's sm100 q_stage: two Q tiles per CTA when the (packed) query rows exceed one tile
    (never at head_dim_v 256: tensor memory); sm90: 1."""
    if not is_blackwell(arch):
        return 1
    return 2 if rows > tile.m and head_dim_v != 256 else 1


def split_s_ping_pong(
    head_dim: int,
    head_dim_v: int,
    tile: Tile,
    q_stage_: int,
    page_size: int | None,
    has_sink: bool,
    has_score_mod: bool,
    seqlen_k_loaded: int,
    num_splits: int,
) -> bool:
    """FA4's `use_s_ping_pong` for a split (num_splits > 1) sm100 kernel (interface.py, b36)."""
    blocks = -(-(-(-seqlen_k_loaded // tile.n)) // num_splits)
    return (
        q_stage_ == 1
        and head_dim in (64, 128, 256)
        and head_dim_v == head_dim
        and tile == Tile(128, 128)
        and page_size in (None, tile.n)
        and not has_score_mod
        and not has_sink
        and blocks >= S_PING_PONG_MIN_BLOCKS_PER_SPLIT.get(head_dim, float("inf"))
    )


# FA4 switches varlen scheduling to a precomputed per-batch tile cumsum above this batch size.
BIN_BATCH_SEARCH_THRESH = 256


# The form of a packed K's bounds-mode forward (part `fwd_bounds`, its record's `rows`;
# forwards.trace_chunk_modes(bounds=True)): 2, cu_seqlens_k as (b + 1, rows, chunk, causal
# shift, anchor), which serves one-row steps, unrolled speculative rows and packed ones with
# their causal tail (split.bounds_part); 1, (b + 1, rows, chunk, 1 + causal), no anchor (an
# early store's); absent, the one-row (b + 1, chunk) form.
BOUNDS_FORM = 2
