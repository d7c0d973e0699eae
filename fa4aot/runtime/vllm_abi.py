"""The argument lists of kernels built from vLLM 0.33.0's FA4 copy (`fa4aot build --fa4 vllm`) on
sm90: what `vllm/vllm_flash_attn/cute/interface.py` prepares and passes its compiled forward
(21 slots) and combine (10 slots), spelled for the compiler-free runtime.

Differences from upstream's (runtime/abi.py): `dynamic_causal` at slot 10 (the page table moves
to 11); the FP8-KV descales (`DescaleTensors(q, k, v)`, a plain tuple here: tvm-ffi converts
both to one Array) at 17 and the fused output scale at 18, before the two cu_total slots; the
combine takes an output scale last. `tests/fa4/test_vllm_abi.py` checks every list against the
copy's own calls, slot by slot. Imports torch (and the split cost model) only.

FP8-KV dequant (`fp8_kv_prepare`): bf16/fp16 Q, e4m3 K/V given to the kernel as uint8 views,
fp32 (batch, kv_heads) K/V descales with a ones q descale; O in Q's dtype.

Split-KV (`SplitKv`): a long decode step of a paged decode kernel runs the copy's split forward
(the variant with `split_kv`, built beside it: fa4/vllm_copy.split_twin) into fp32 partials,
then the copy's combine for the call's query heads and split-count bucket, as the copy's
`_flash_attn_fwd` does for `num_splits > 1`. The count comes from host-known sizes only
(batch, KV heads, the KV bound: max_seqlen_k or the page table's capacity) through
policy/split.choose_splits, so nothing syncs and a captured CUDA graph replays it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fa4aot.errors import UnsupportedVariant
from fa4aot.model import constraints as C
from fa4aot.model.abis import VLLM_COMBINE, VLLM_SM90_FWD  # noqa: F401 (the tables these spell)
from fa4aot.model.compile_keys import features
from fa4aot.policy import split as S
from fa4aot.runtime import launch as L

AUX_NONE = (None, None)  # AuxData(tensors=None, scalars=None): a compile-time value
FP8_KV = (torch.float8_e4m3fn,)


def fwd_args(
    q, k, v, out, lse, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, *, dynamic_causal=None, descales: tuple | None = None,
    output_scale=None, cu_total_m_blocks=None, cu_total_splits_m_blocks=None,
) -> tuple:  # fmt: skip
    """The 21 positional arguments of the copy's compiled sm90 forward (VLLM_SM90_FWD):
    block sparsity None and empty aux data, as the runtime serves neither."""
    return (
        q, k, v, out, lse, softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dynamic_causal, page_table,
        window_left, window_right, learnable_sink,
        None, AUX_NONE,
        descales, output_scale,
        cu_total_m_blocks, cu_total_splits_m_blocks,
    )  # fmt: skip


def launch_sm90(
    fwd, q, k, v, out, lse, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, cu_total_m_blocks=None, descales=None,
):  # fmt: skip
    """fwd(*fwd_args(...)) without building the tuple; the first 16 parameters are the
    runtime's bound launchers' (runtime/launch.py), as abi.launch_sm90's are."""
    return fwd(
        q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        None, page_table, window_left, window_right, learnable_sink, None, AUX_NONE,
        descales, None, cu_total_m_blocks, None,
    )  # fmt: skip


def combine_args(out_partial, lse_partial, out, lse, cu_seqlens=None, seqused=None,
                 num_splits_dynamic=None, virtual_batch_idx=None, semaphore_to_reset=None,
                 output_scale=None) -> tuple:  # fmt: skip
    """The copy's compiled combine's 10 slots (VLLM_COMBINE)."""
    return (out_partial, lse_partial, out, lse, cu_seqlens, seqused, num_splits_dynamic,
            virtual_batch_idx, semaphore_to_reset, output_scale)


def fp8_kv_prepare(q, k, v, k_descale, v_descale) -> tuple:
    """(k, v, descales) as the copy passes them under fp8_kv_dequant: K/V viewed as uint8, and
    (ones like k_descale, k_descale, v_descale). ValueError unless Q is bf16/fp16, K/V e4m3 and
    both descales fp32 (batch, kv_heads) with the head stride 1 (the kernel's leading dim)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"FP8-KV dequant takes bf16/fp16 q, not {q.dtype}")
    if k.dtype not in FP8_KV or v.dtype != k.dtype:
        raise ValueError(f"FP8-KV dequant takes e4m3 k and v, not {k.dtype}/{v.dtype}")
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None or d.dtype != torch.float32 or d.dim() != 2 or d.stride(1) != 1:
            got = None if d is None else (d.dtype, tuple(d.shape), d.stride())
            raise ValueError(f"FP8-KV dequant needs {name}: float32 (batch, kv_heads) with "
                             f"stride 1 over heads (got {got})")
    return k.view(torch.uint8), v.view(torch.uint8), (torch.ones_like(k_descale), k_descale,
                                                       v_descale)


@dataclass
class Prep:
    """A call's kernel-side buffers: `kernel_out` / `kernel_lse` go to the forward (the
    partials when split), `out` / `lse` are the call's results."""

    out: torch.Tensor
    lse: torch.Tensor | None
    kernel_out: torch.Tensor
    kernel_lse: torch.Tensor | None
    num_splits: int

    def combine(self, cu_seqlens_q=None, seqused_q=None) -> tuple:
        """The combine's arguments after a split forward: partial LSE and LSE seqlen-major
        (the copy's `lse_partial.transpose(-1, -2)`)."""
        return combine_args(self.kernel_out, self.kernel_lse.transpose(-1, -2), self.out,
                            None if self.lse is None else self.lse.transpose(-1, -2),
                            cu_seqlens_q, seqused_q)


def prepare(q, head_dim_v: int, *, varlen_q: bool, out=None, return_lse: bool = False,
            num_splits: int = 1) -> Prep:
    """The copy's output buffers for q (packed (total_q, h, d) when varlen_q, else (b, s, h,
    d)): O in q's dtype; LSE fp32 (h, total_q) / (b, h, s) when asked for; with num_splits > 1
    fp32 partials (n, *q's rows, h, dv) and (n, *LSE's shape)."""
    rows = q.shape[:1] if varlen_q else q.shape[:2]
    h = q.shape[-2]
    if out is None:
        out = q.new_empty(*rows, h, head_dim_v)
    lse_shape = (h, rows[0]) if varlen_q else (rows[0], h, rows[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if num_splits <= 1:
        return Prep(out, lse, out, lse, 1)
    op = torch.empty(num_splits, *rows, h, head_dim_v, dtype=torch.float32, device=q.device)
    lp = torch.empty(num_splits, *lse_shape, dtype=torch.float32, device=q.device)
    return Prep(out, lse, op, lp, num_splits)


# the copy's combine asserts at most 256 partials; its smallest bucket at these head dims is 32
MAX_SPLITS = 256


def combine_bucket(n: int) -> int:
    """The largest split count of the combine the copy compiles for n splits:
    2**max(ceil(log2 n), 5) (interface.py `_flash_attn_fwd_combine`, tile_m 8 at d > 64)."""
    return 1 << max((n - 1).bit_length(), 5)


@dataclass(slots=True)
class SplitKv:
    """A decode variant's split forward built from vLLM's copy (bound by `fwd`, the store's
    forward binder) and its combines by (query heads, largest split count), as loaded."""

    fwd: Any
    combines: dict[tuple[int, int], Any]
    tile_n: int
    bind: Callable
    paged_tma: bool = True
    launch: Callable = field(init=False)
    _counts: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.launch = self.bind(self.fwd, guard=self.paged_tma)

    def largest(self, num_head: int) -> int:
        """The most splits a combine here takes for `num_head` query heads (0: none)."""
        return max((n for h, n in self.combines if h == num_head), default=0)

    def count(self, *, setting: int, batch: int, hq: int, hk: int, bound: int,
              bytes_per_key: int, num_sms: int, model: S.CostModel) -> int:
        """The split count of a decode step (1: unsplit; always at a bound of at most
        split.NEVER_SPLIT_KEYS keys, as upstream's split). setting: FA4AOT_SPLIT_KV (-1 auto:
        policy/split.choose_splits over the bound rounded up to split.PLAN_KEYS, with the
        copy's key block as the chunk alignment and the unsplit step on FA4's own kernel; 0
        never; k > 0: k); capped by the combines built for hq. Cached per host-known sizes."""
        key = (setting, batch, hq, hk, S.plan_bucket(bound))
        n = self._counts.get(key)
        if n is None:
            top = min(self.largest(hq), MAX_SPLITS)
            if setting == 0 or top < 2 or bound <= S.NEVER_SPLIT_KEYS:
                n = 1
            elif setting > 0:
                n = min(setting, top)
            else:
                n = S.choose_splits(batch=batch, kv_heads=hk, rows=1, seqlen_k=key[-1],
                                    bytes_per_key=bytes_per_key, num_sms=num_sms,
                                    align=self.tile_n, max_splits=top, model=model, fold=False)
            if n > 1 and (hq, combine_bucket(n)) not in self.combines:
                # (a store without that bucket's combine: the largest smaller one that it has)
                n = max((b for h, b in self.combines if h == hq and b < n), default=1)
            if len(self._counts) > 4096:
                self._counts.clear()
            self._counts[key] = n
        return n

    def run(self, n: int, q, k, v, out, softmax_scale: float, cu_seqlens_q, seqused_k,
            page_table, window_left, window_right, descales=None):
        """The copy's split forward over n splits into fp32 partials, then its combine into
        `out` (LSE not returned: split_twin builds no LSE twin). -> out."""
        varlen_q = cu_seqlens_q is not None
        p = prepare(q, out.shape[-1], varlen_q=varlen_q, out=out, num_splits=n)
        self.launch(q, k, v, p.kernel_out, p.kernel_lse, softmax_scale, cu_seqlens_q, None,
                    None, seqused_k, page_table, window_left, window_right, None, None,
                    descales=descales)
        self.combines[q.shape[-2], combine_bucket(n)](*p.combine(cu_seqlens_q, None))
        return out


def split_kernels(rt, variant, num_sms: int) -> SplitKv | None:
    """The split twin of `variant` (the same variant with `split_kv`) from `rt`'s stores, with
    its combines (parts carrying `max_splits` and `num_head`), loaded once per artifact; None
    where the stores lack it (the step then runs unsplit)."""
    if variant is None or variant.split_kv or not variant.paged or variant.return_lse:
        return None
    twin = replace(variant, split_kv=True)
    with rt._lock:
        art = rt.find(twin, num_sms)
        if art is None:
            return None
        key = ("vllm-split", art.id)
        got = rt._modules.get(key)
        if got is None:
            parts = art.record["parts"]
            names = [n for n, p in parts.items() if "max_splits" in p and "num_head" in p]
            fwd, *kernels = rt._load(art, "fwd", *names)
            combines = {(int(parts[n]["num_head"]), int(parts[n]["max_splits"])): kern
                        for n, kern in zip(names, kernels)}
            got = rt._modules[key] = (fwd, combines, int(parts["fwd"].get("tile_n", 64)),
                                      L.abi_for(twin.arch, rt.abi_of(art)).fwd)
    fwd, combines, tile_n, bind = got
    return SplitKv(fwd, combines, tile_n, bind, paged_tma=twin.paged_tma is not False)


def split_step(rt, plan, dev: int, q, k, v, out, batch: int, hk: int, max_seqlen_k,
               page_table, seqused_k, cu_seqlens_q, softmax_scale: float, descales=None):
    """Serve a paged call of `plan` (a store built from vLLM's copy) split, or return None (run
    it unsplit): the plan's variant has no split twin in the stores, or SplitKv.count says 1.
    The KV bound is max_seqlen_k when the caller gives it (its contract: it bounds every
    sequence's length), else the page table's capacity. The twin is looked up once per plan."""
    key = ("vllm-split-plan", id(plan))
    got = rt._modules.get(key)
    if got is None:  # (the plan is kept beside it, so its id is not reused)
        got = rt._modules[key] = (plan, split_kernels(rt, plan.variant, rt.device(dev)[1]))
    sk = got[1]
    if sk is None or page_table is None:
        return None
    bound = (max_seqlen_k if type(max_seqlen_k) is int and max_seqlen_k >= 0
             else page_table.shape[1] * k.shape[1])
    n = sk.count(setting=rt.split, batch=batch, hq=q.shape[-2], hk=hk, bound=bound,
                 bytes_per_key=(k.shape[-1] + v.shape[-1]) * k.element_size(),
                 num_sms=rt.device(dev)[1], model=rt.cost_model(dev))
    if n < 2:
        return None
    return sk.run(n, q, k, v, out, softmax_scale, cu_seqlens_q, seqused_k, page_table,
                  plan.window_left, plan.window_right, descales)


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def warm(rt, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
         max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None,
         causal=False, window_size=(None, None), learnable_sink=None, return_lse=False, *,
         out=None, lse=None, softcap=0.0, pack_gqa=None, num_splits=1, fp8_kv_dequant=None,
         **descales):
    """vLLM's compile-only call (flash_attn_varlen_func's arguments as shape-only tensor specs:
    `.shape`, `.dtype`, no data) answered from `rt`'s stores on the current CUDA device: the
    kernel a call of these static features runs is loaded (its plan made, as the call would),
    and for num_splits != 1 its split twin too (split_kernels); nothing is launched.
    -> (out, lse) as given. ArtifactMissing (the miss recorded, as a call's would be) where the
    stores lack the kernel; UnsupportedVariant for what the runtime does not serve exactly."""
    fp8 = k.dtype in FP8_KV
    if q.dtype not in _DTYPES or (k.dtype != q.dtype and not fp8) or descales or (
            fp8 and fp8_kv_dequant is False):
        raise UnsupportedVariant(f"compile-only: q {q.dtype}, k {k.dtype} are not served")
    dev = torch.cuda.current_device()
    arch, sms = rt.device(dev)
    varlen_q = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    total_q = q.shape[0] if varlen_q else q.shape[0] * q.shape[1]
    d, dv = q.shape[-1], v.shape[-1]
    why = C.unsupported_reason(arch, _DTYPES[q.dtype], d, dv, fa4=rt.fa4_abi(arch, sms))
    if why:
        raise UnsupportedVariant(why)
    wl, wr = window_size
    variant = features(
        arch=arch, dtype=_DTYPES[q.dtype], head_dim=d, head_dim_v=dv, num_heads=q.shape[-2],
        num_heads_kv=k.shape[-2], causal=bool(causal), window_left=wl, window_right=wr,
        return_lse=bool(return_lse or lse is not None),
        sink_dtype=None if learnable_sink is None else str(learnable_sink.dtype)[6:],
        batch=batch, seqlen_q=None if varlen_q else q.shape[1], total_q=total_q,
        max_seqlen_q=max_seqlen_q if varlen_q else None, cu_seqlens_q=varlen_q,
        cu_seqlens_k=cu_seqlens_k is not None, seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
        page_size=None if page_table is None else k.shape[1], softcap=softcap or None,
        pack_gqa=pack_gqa, kv_dtype=C.FP8_KV if fp8 else None,
    )
    if rt.plan(variant, sms) is None:
        rt.miss(variant, sms, False)  # (raises ArtifactMissing naming the build)
    if num_splits != 1:
        sk = split_kernels(rt, variant, sms)
        if sk is not None:  # its combines answer the combine warm-up that follows (warm_combine)
            held = rt._modules.setdefault(_warmed_key(arch, q.dtype, dv, varlen_q), set())
            held.update(sk.combines)
    return out, lse


def _warmed_key(arch: str, dtype, head_dim_v: int, varlen_q: bool) -> tuple:
    return ("vllm-warmed-combines", arch, str(dtype), head_dim_v, varlen_q)


def warm_combine(rt, out_partial, lse_partial, out, *, varlen: bool) -> None:
    """vLLM's combine warm-up (`_flash_attn_fwd_combine` on fake tensors after a split
    compile-only call, v1/attention/backends/flash_attn.py:254) answered from `rt`'s stores:
    the copy compiles one combine per (out dtype, head dim, query heads, split bucket, varlen),
    and a split twin that `warm` loaded for this device holds it exactly or not at all. Nothing
    is loaded or launched here. ArtifactMissing where no loaded twin holds that combine (the
    warm-up then goes back, and vLLM compiles it)."""
    from fa4aot.errors import ArtifactMissing

    arch, _ = rt.device(torch.cuda.current_device())
    heads, splits, dv = out_partial.shape[-2], out_partial.shape[0], out_partial.shape[-1]
    held = rt._modules.get(_warmed_key(arch, out.dtype, dv, varlen), set())
    if out_partial.dtype != torch.float32 or lse_partial.dtype != torch.float32 or (
            heads, combine_bucket(splits)) not in held:
        built = ", ".join(f"{h} heads/{n}" for h, n in sorted(held)) or "none loaded"
        raise ArtifactMissing(
            f"vLLM's FA4 copy: no stored combine for {heads} query heads, {splits} splits "
            f"(bucket {combine_bucket(splits)}), {out.dtype} hd{dv}; the split twins warmed "
            f"here hold: {built}")
