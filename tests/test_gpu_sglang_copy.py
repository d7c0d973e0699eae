"""Kernels built from SGLang 0.5.23's FA4 copy, served on sm90 by fa4aot's compiler-free runtime
(marker `gpu`): Llama-3.1-8B's shapes (hd128, 32:8 GQA and TP8's 4:1, bf16, causal) dense,
varlen (and a varlen decode at batch 300, which the copy runs with no helper kernel), paged at
page 128 (its TMA path), 64 and 16 (its cp.async path), decode and prefill.

    fa4aot build --fa4 <SGLang's copy: a cute/ dir> --arch sm90 --spec llama-3.1-8b  (CPU)
    FA4AOT_CACHE_DIR=<store> FA4AOT_ENGINE_SRC=<dir holding sglang/> \\
        pytest -m gpu tests/test_gpu_sglang_copy.py

Each case draws fresh random inputs (SGLang's paged cache: (pages, page, kv_heads, d) per K and
V, a shuffled page table), hands the runtime an output buffer full of NaN, and checks that none
survives and that the output is within TOL of an fp32 reference. Where SGLang's copy imports
(FA4AOT_ENGINE_SRC, or an installed sglang, with cutlass), the same call through the copy's JIT
(`_flash_attn_fwd`, num_splits 1: the runtime serves these calls unsplit) must give a
bit-identical output.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from reference import attention_ref, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 against fp32: ~3e-3 expected
SEEDS = (0, 1)


@dataclass(frozen=True)
class Case:
    name: str
    layout: str  # dense | varlen | paged
    batch: int
    max_q: int  # query rows per sequence (1: decode); sequences get 1..max_q rows
    max_k: int
    hq: int = 32
    hk: int = 8
    d: int = 128
    page: int | None = None


CASES = [
    Case("dense_prefill", "dense", 2, 512, 512),
    Case("varlen_prefill", "varlen", 3, 700, 700),
    Case("varlen_decode_b300", "varlen", 300, 1, 600),
    Case("p128_decode", "paged", 8, 1, 4096, page=128),
    Case("p128_prefill", "paged", 3, 300, 1200, page=128),
    Case("p64_decode", "paged", 8, 1, 4096, page=64),
    Case("p16_decode", "paged", 8, 1, 4096, page=16),
    Case("p16_prefill", "paged", 3, 300, 1200, page=16),
    Case("p16_decode_tp8", "paged", 8, 1, 4096, hq=4, hk=1, page=16),
]


@pytest.fixture(scope="module", autouse=True)
def _sglang_store():
    """Serve from the stores built from SGLang's copy (FA4AOT_KERNEL_SOURCE=sglang); skip
    without one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from fa4aot import settings
    from fa4aot.errors import FingerprintMismatch
    from fa4aot.runtime import reset

    with settings.scope(kernel_source="sglang"):
        rt = reset()
        arch, sms = rt.device(torch.cuda.current_device())
        try:
            stores = rt.stores_for(arch, sms)
        except FingerprintMismatch as e:
            pytest.skip(f"no store built from SGLang's copy for this GPU: {e}")
        if not stores:
            pytest.skip("no store built from SGLang's copy: build with `fa4aot build --fa4 "
                        "<its cute/ dir> --arch sm90 --spec llama-3.1-8b`")
        yield
    reset()


def make(case: Case, gen: torch.Generator, dev="cuda") -> dict:
    """Fresh random inputs for `case` (lengths, values, page order drawn from `gen`)."""
    b, d = case.batch, case.d

    def randint(lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    if case.layout == "dense":
        inp = {"lq": [case.max_q] * b, "lk": [case.max_k] * b, "case": case}
        inp.update(q=randn(b, case.max_q, case.hq, d), k=randn(b, case.max_k, case.hk, d),
                   v=randn(b, case.max_k, case.hk, d))
        return inp
    lk = randint(max(1, case.max_k // 2), case.max_k, b)
    lq = [1] * b if case.max_q == 1 else [min(x, k) for x, k in
                                          zip(randint(1, case.max_q, b), lk)]
    if case.layout == "varlen" and case.max_q > 1:
        lk = lq  # (self-attention prefill)
    inp: dict = {"lq": lq, "lk": lk, "case": case, "q": randn(sum(lq), case.hq, d)}

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=dev)

    inp["cu_seqlens_q"] = cu(lq)
    if case.layout == "varlen":
        inp.update(k=randn(sum(lk), case.hk, d), v=randn(sum(lk), case.hk, d),
                   cu_seqlens_k=cu(lk))
        return inp
    npp = -(-case.max_k // case.page)
    blocks = b * npp + 3
    perm = torch.randperm(blocks, generator=gen)[: b * npp].view(b, npp)
    inp.update(k=randn(blocks, case.page, case.hk, d), v=randn(blocks, case.page, case.hk, d),
               page_table=perm.to(dev, torch.int32).contiguous(),
               seqused_k=torch.tensor(lk, dtype=torch.int32, device=dev))
    return inp


def reference(inp: dict) -> torch.Tensor:
    """fp32 output in the call's own q layout (causal, bottom-right)."""
    case, lq, lk = inp["case"], inp["lq"], inp["lk"]
    if case.layout == "dense":
        q, k, v = inp["q"], inp["k"].float(), inp["v"].float()
    else:
        b, sk, sq = case.batch, max(lk), max(lq)
        k = torch.zeros(b, sk, case.hk, case.d, device=inp["q"].device)
        v = torch.zeros_like(k)
        q = torch.zeros(b, sq, case.hq, case.d, device=k.device, dtype=inp["q"].dtype)
        for i, (n, m) in enumerate(zip(lk, lq)):
            s = int(inp["cu_seqlens_q"][i])
            q[i, :m] = inp["q"][s:s + m]
            if case.layout == "varlen":
                s = int(inp["cu_seqlens_k"][i])
                k[i, :n], v[i, :n] = inp["k"][s:s + n].float(), inp["v"][s:s + n].float()
            else:
                pages = inp["page_table"][i, : -(-n // case.page)].long()
                k[i, :n] = inp["k"][pages].reshape(-1, case.hk, case.d)[:n].float()
                v[i, :n] = inp["v"][pages].reshape(-1, case.hk, case.d)[:n].float()
    dev = q.device
    o, _ = attention_ref(q, k, v, torch.tensor(lq, device=dev), torch.tensor(lk, device=dev),
                         causal=True, scale=1 / math.sqrt(case.d))
    if case.layout == "dense":
        return o
    return torch.cat([o[i, :n] for i, n in enumerate(lq)])


def _kw(inp: dict) -> dict:
    case = inp["case"]
    kw = dict(cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=max(inp["lq"]), causal=True)
    if case.layout == "varlen":
        kw.update(cu_seqlens_k=inp["cu_seqlens_k"], max_seqlen_k=max(inp["lk"]))
    else:
        kw.update(page_table=inp["page_table"], seqused_k=inp["seqused_k"],
                  max_seqlen_k=max(inp["lk"]))
    return kw


def fa4aot_call(inp: dict, out: torch.Tensor):
    import fa4aot

    if inp["case"].layout == "dense":
        return fa4aot.flash_attn_func(inp["q"], inp["k"], inp["v"], causal=True, out=out)[0]
    return fa4aot.flash_attn_varlen_func(inp["q"], inp["k"], inp["v"], out=out, **_kw(inp))[0]


_COPY = None


def sglang_copy():
    """SGLang's FA4 copy's interface module (JIT), or None: found at $FA4AOT_ENGINE_SRC (a
    directory holding `sglang/`, e.g. the copy extracted from the wheel) or as an installed
    sglang; needs cutlass."""
    global _COPY
    if _COPY is None:
        try:
            from fa4aot.fa4 import sources

            src = os.environ.get("FA4AOT_ENGINE_SRC")
            root = os.path.join(src, "sglang") if src else None
            _COPY = sources.load(sources.resolve("sglang", root=root))
        except Exception as e:  # noqa: BLE001 (reported by the caller as the skip reason)
            _COPY = e
    return None if isinstance(_COPY, Exception) else _COPY


def copy_call(inp: dict, out: torch.Tensor):
    """The same call through SGLang's copy, as its FA4 wrapper makes it (num_splits 1)."""
    I = sglang_copy()
    case = inp["case"]
    kw = dict(softmax_scale=1 / math.sqrt(case.d), causal=True, num_splits=1,
              return_lse=False, out=out)
    if case.layout != "dense":
        kw.update(_kw(inp))
    return I._flash_attn_fwd(inp["q"], inp["k"], inp["v"], **kw)[0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_against_fp32(case, seed):
    gen = torch.Generator().manual_seed(1000 * seed + zlib.crc32(case.name.encode()) % 997)
    inp = make(case, gen)
    out = torch.full_like(inp["q"], float("nan"))
    got = fa4aot_call(inp, out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), f"{case.name}: NaN survives in the output"
    err = rel_err(got, reference(inp))
    assert err < TOL, f"{case.name}: rel err {err:.2e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bit_identical_to_sglangs_copy(case):
    if sglang_copy() is None:
        pytest.skip(f"SGLang's FA4 copy does not import here: {_COPY!r}")
    inp = make(case, torch.Generator().manual_seed(7))
    ours = fa4aot_call(inp, torch.full_like(inp["q"], float("nan")))
    theirs = copy_call(inp, torch.full_like(inp["q"], float("nan")))
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs), (
        f"{case.name}: max |diff| {(ours.float() - theirs.float()).abs().max().item():.3e}")
