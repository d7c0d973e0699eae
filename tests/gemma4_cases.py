"""Gemma-4 full-attention calls on sm90 in vLLM's layout, shared by the GPU test
(test_gpu_gemma4_vllm.py) and benchmarks/gemma4_sm90.py: inputs, the call through fa4aot's
runtime, the same call through vLLM's FA4 copy (JIT), and an fp32 reference.

K/V are views of vLLM's cache: (blocks, kv_heads, page, 2 * d).transpose(1, 2).split(d, -1),
so each is (blocks, page, kv_heads, d) with token stride 2d; the page table is shuffled; FP8
K/V are e4m3 with fp32 (batch, kv_heads) descales (vLLM's `layer._k_scale.expand(b, hk)`,
contiguous)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    name: str
    layout: str  # paged | varlen | dense
    batch: int
    max_q: int  # query rows per sequence (1: decode); sequences get 1..max_q rows
    max_k: int
    hq: int = 32
    hk: int = 4
    d: int = 512
    page: int | None = 64
    fp8: bool = False


CASES = [
    Case("bf16_p64_decode", "paged", 8, 1, 4096),
    Case("bf16_p64_decode_tp8", "paged", 8, 1, 4096, hq=4, hk=1),
    Case("bf16_p64_prefill", "paged", 3, 300, 1200),
    Case("bf16_p16_decode", "paged", 8, 1, 4096, page=16),
    Case("bf16_p16_prefill", "paged", 3, 300, 1200, page=16),
    Case("fp8_p64_decode", "paged", 8, 1, 4096, fp8=True),
    Case("fp8_p64_decode_tp8", "paged", 8, 1, 4096, hq=4, hk=1, fp8=True),
    Case("fp8_p64_prefill", "paged", 3, 300, 1200, fp8=True),
    Case("bf16_varlen_prefill", "varlen", 3, 700, 700, page=None),
    Case("bf16_dense_prefill", "dense", 2, 512, 512, page=None),
]

# Long-context decode: few (sequence, KV head) CTAs over many keys, which the runtime splits on
# the copy's split forward and combine (runtime/vllm_abi.SplitKv; store: the split twins)
LONG_CASES = [
    Case("bf16_p64_long_b1", "paged", 1, 1, 65536),
    Case("bf16_p64_long_b4", "paged", 4, 1, 32768),
    Case("bf16_p16_long_b1", "paged", 1, 1, 32768, page=16),
    Case("fp8_p64_long_b1", "paged", 1, 1, 65536, fp8=True),
    Case("fp8_p64_long_b4", "paged", 4, 1, 32768, fp8=True),
    Case("fp8_p64_long_b1_tp8", "paged", 1, 1, 65536, hq=4, hk=1, fp8=True),
]


def make(case: Case, gen: torch.Generator, dev="cuda") -> dict:
    """Fresh random inputs for `case` (lengths, values, page order drawn from `gen`)."""
    b, d = case.batch, case.d
    bf = torch.bfloat16

    def randint(lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    if case.layout == "dense":
        lq = lk = [case.max_q] * b
    else:
        lk = randint(max(1, case.max_k // 2), case.max_k, b)
        lq = [1] * b if case.max_q == 1 else [min(x, k) for x, k in
                                              zip(randint(1, case.max_q, b), lk)]
        if case.layout == "varlen":
            lq = lk = [min(x, case.max_k) for x in lq]

    def randn(*shape, dtype=bf):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    inp: dict = {"lq": lq, "lk": lk, "case": case}
    if case.layout == "dense":
        inp.update(q=randn(b, case.max_q, case.hq, d), k=randn(b, case.max_k, case.hk, d),
                   v=randn(b, case.max_k, case.hk, d))
        return inp
    inp["q"] = randn(sum(lq), case.hq, d)
    inp["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()],
                                       dtype=torch.int32, device=dev)
    if case.layout == "varlen":
        inp.update(k=randn(sum(lk), case.hk, d), v=randn(sum(lk), case.hk, d),
                   cu_seqlens_k=inp["cu_seqlens_q"].clone())
        return inp
    page = case.page
    npp = -(-case.max_k // page)
    blocks = b * npp + 3
    cache = torch.randn(blocks, case.hk, page, 2 * d, generator=gen).to(dev)
    if case.fp8:
        cache = (cache * 2).clamp(-448, 448).to(FP8)
    else:
        cache = cache.to(bf)
    k, v = cache.transpose(1, 2).split(d, dim=-1)
    perm = torch.randperm(blocks, generator=gen)[: b * npp].view(b, npp)
    inp.update(k=k, v=v, page_table=perm.to(dev, torch.int32).contiguous(),
               seqused_k=torch.tensor(lk, dtype=torch.int32, device=dev))
    if case.fp8:
        inp["k_descale"] = (torch.rand(b, case.hk, generator=gen) * 0.05 + 0.01).to(dev)
        inp["v_descale"] = (torch.rand(b, case.hk, generator=gen) * 0.05 + 0.01).to(dev)
    return inp


def padded_kv(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V gathered per sequence into (b, max_k, hk, d) fp32 (FP8: dequantized with the
    descales), zero past each length."""
    case, lk = inp["case"], inp["lk"]
    if case.layout == "dense":
        return inp["k"].float(), inp["v"].float()
    b, sk = case.batch, max(lk)
    out = []
    for name in ("k", "v"):
        t = inp[name]
        buf = torch.zeros(b, sk, case.hk, case.d, device=t.device)
        for i, n in enumerate(lk):
            if case.layout == "varlen":
                start = int(inp["cu_seqlens_k"][i])
                rows = t[start:start + n].float()
            else:
                pages = inp["page_table"][i, : -(-n // case.page)].long()
                rows = t[pages].reshape(-1, case.hk, case.d)[:n].float()
            if case.fp8:
                rows = rows * inp[f"{name}_descale"][i].view(1, -1, 1)
            buf[i, :n] = rows
        out.append(buf)
    return out[0], out[1]


def reference(inp: dict, attention_ref) -> torch.Tensor:
    """fp32 output in the call's own q layout (causal, bottom-right)."""
    case, lq, lk = inp["case"], inp["lq"], inp["lk"]
    k, v = padded_kv(inp)
    b, sq = case.batch, max(lq)
    if case.layout == "dense":
        q = inp["q"]
    else:
        q = torch.zeros(b, sq, case.hq, case.d, device=k.device, dtype=inp["q"].dtype)
        for i, n in enumerate(lq):
            s = int(inp["cu_seqlens_q"][i])
            q[i, :n] = inp["q"][s:s + n]
    dev = k.device
    o, _ = attention_ref(q, k, v, torch.tensor(lq, device=dev), torch.tensor(lk, device=dev),
                         causal=True, scale=1 / math.sqrt(case.d))
    if case.layout == "dense":
        return o
    return torch.cat([o[i, :n] for i, n in enumerate(lq)])


def fa4aot_call(inp: dict, out: torch.Tensor | None = None):
    """The call through fa4aot's runtime (flash_attn_varlen_func / flash_attn_func)."""
    import fa4aot

    case = inp["case"]
    if case.layout == "dense":
        return fa4aot.flash_attn_func(inp["q"], inp["k"], inp["v"], causal=True, out=out)[0]
    kw = dict(cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=max(inp["lq"]), causal=True,
              out=out)
    if case.layout == "varlen":
        kw.update(cu_seqlens_k=inp["cu_seqlens_k"], max_seqlen_k=max(inp["lk"]))
    else:
        kw.update(page_table=inp["page_table"], seqused_k=inp["seqused_k"],
                  max_seqlen_k=max(inp["lk"]))
    if case.fp8:
        kw.update(k_descale=inp["k_descale"], v_descale=inp["v_descale"])
    return fa4aot.flash_attn_varlen_func(inp["q"], inp["k"], inp["v"], **kw)[0]


def runtime_splits() -> int:
    """The split count fa4aot's default runtime chose for its vLLM split steps since it was
    last reset (1: every step ran unsplit): the counts SplitKv.count cached. AssertionError if
    it chose several (a test makes one call per fresh runtime)."""
    from fa4aot.runtime import default_runtime

    got = {n for key, val in default_runtime()._modules.items()
           if isinstance(key, tuple) and key[0] == "vllm-split-plan" and val[1] is not None
           for n in val[1]._counts.values()}
    assert len(got) <= 1, f"several split counts: {got}"
    return got.pop() if got else 1


_COPY = None


def vllm_copy():
    """vLLM's FA4 copy's interface module (JIT), or None: found as an installed vllm, or at
    $FA4AOT_ENGINE_SRC (a directory holding `vllm/`, e.g. an unpacked wheel); needs cutlass."""
    global _COPY
    if _COPY is None:
        try:
            from fa4aot.fa4 import sources

            src = os.environ.get("FA4AOT_ENGINE_SRC")
            root = os.path.join(src, "vllm") if src else None
            _COPY = sources.load(sources.resolve("vllm", root=root))
        except Exception as e:  # noqa: BLE001 (reported by the caller as the skip reason)
            _COPY = e
    return None if isinstance(_COPY, Exception) else _COPY


def copy_skip_reason() -> str:
    vllm_copy()
    return f"vLLM's FA4 copy does not import here: {_COPY!r}"


def copy_call(inp: dict, out: torch.Tensor | None = None, num_splits: int = 1):
    """The same call through vLLM's copy, as vLLM's flash_attn_varlen_func makes it."""
    I = vllm_copy()
    case = inp["case"]
    kw = dict(softmax_scale=1 / math.sqrt(case.d), causal=True, num_splits=num_splits,
              return_lse=False, out=out)
    if case.layout != "dense":
        kw.update(cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=max(inp["lq"]))
    if case.layout == "varlen":
        kw.update(cu_seqlens_k=inp["cu_seqlens_k"], max_seqlen_k=max(inp["lk"]))
    elif case.layout == "paged":
        kw.update(page_table=inp["page_table"], seqused_k=inp["seqused_k"],
                  max_seqlen_k=max(inp["lk"]))
    if case.fp8:
        kw.update(k_descale=inp["k_descale"], v_descale=inp["v_descale"], fp8_kv_dequant=True)
    return I._flash_attn_fwd(inp["q"], inp["k"], inp["v"], **kw)[0]
