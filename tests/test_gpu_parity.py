"""FA4 parity on the GPU (issue 13; marker `gpu`): the forward layouts, softcap values, explicit
pack_gqa choices and sink dtypes fa4aot learned to build, served and checked against an fp32
reference.

Every case draws fresh random inputs and lengths (zero-length and one-token sequences
included), hands the runtime NaN-filled `out=` / `lse=` buffers and checks the valid rows.
The same calls then go through FA4's own interface under `fa4aot.install(on_miss="error")`
(needs the compiler bundle; skipped without `flash_attn.cute`): same reference, zero compiles.

The store comes from the tests' own miss log, in one round (docs/gpu-tests.md):

    FA4AOT_CACHE_DIR=S FA4AOT_MISS_LOG=m.jsonl pytest -m gpu tests/test_gpu_parity.py  # misses
    fa4aot build --cache S --from-misses m.jsonl
    FA4AOT_CACHE_DIR=S pytest -m gpu tests/test_gpu_parity.py                          # passes
"""

from __future__ import annotations

import os
import random
import zlib

import pytest

torch = pytest.importorskip("torch")

from reference import attention_ref, paged_kv, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 attention vs fp32: ~2e-3 seen
LSE_TOL = 1e-3
SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


# (id, q form, K/V form, phase, extras): extras are runtime keyword arguments or test knobs
# (hq, hk, d, dtype, batch, page, window).
CASES = []
for qf, kvf in [
    ("packed", "batch+seqused"),  # "padded": a static / padded KV cache
    ("batch+seqused", "batch+seqused"),
    ("batch+seqused", "packed"),
    ("packed+seqused", "packed"),
    ("batch", "batch+seqused"),
    ("packed", "packed+seqused"),
]:
    for phase in ("decode", "prefill"):
        CASES.append((f"{qf}/{kvf}-{phase}", qf, kvf, phase, {}))
CASES += [
    ("padded-decode-b300", "packed", "batch+seqused", "decode", {"batch": 300}),
    ("padded-window", "packed", "batch+seqused", "prefill", {"window": 64}),
    ("softcap30-dense-decode", "batch", "batch", "decode", {"softcap": 30.0}),
    ("softcap30-dense-prefill", "batch", "batch", "prefill", {"softcap": 30.0}),
    ("softcap50-varlen-prefill", "packed", "packed", "prefill", {"softcap": 50.0}),
    ("softcap30-paged-decode", "packed", "paged+seqused", "decode", {"softcap": 30.0, "page": 64}),
    ("pack_gqa-true-decode", "batch", "batch", "decode", {"pack_gqa": True}),
    ("pack_gqa-false-decode", "batch", "batch", "decode", {"pack_gqa": False}),
    ("pack_gqa-true-prefill", "batch", "batch", "prefill", {"pack_gqa": True}),
    ("pack_gqa-false-varlen", "packed", "packed", "prefill", {"pack_gqa": False}),
]
for sd in ("bfloat16", "float16", "float32"):
    # gpt-oss's attention: hd64, 64:8, sinks, sliding window 128 on half the layers
    gpt = {"sink": sd, "hq": 64, "hk": 8, "d": 64}
    CASES += [
        (f"sink-{sd}-dense-decode", "batch", "batch", "decode", dict(gpt)),
        (f"sink-{sd}-varlen-window", "packed", "packed", "prefill", dict(gpt, window=128)),
    ]
CASES.append(("sink-bfloat16-padded-decode", "packed", "batch+seqused", "decode",
              {"sink": "bfloat16", "hq": 64, "hk": 8, "d": 64}))
IDS = [c[0] for c in CASES]


def _lengths(rng, b, phase, q_full, k_full):
    """Per-sequence (lq, lk), lq <= lk; a zero-length and a one-token sequence where the forms
    allow them (a full batch-form q or K has one length for all)."""
    if phase == "decode":
        lq = [1] * b
        lk = [rng.randint(1, 700) for _ in range(b)]
    else:
        lq = [rng.randint(1, 200) for _ in range(b)]
        lk = [n + rng.randint(0, 300) for n in lq]
        if b > 2:
            lq[0], lk[0] = 1, 1  # one-token sequence
    if b > 2 and not q_full:
        lq[1] = 0  # zero-length query sequence
        if not k_full:
            lk[1] = 0 if phase == "prefill" else lk[1]
    if q_full:
        lq = [max(lq)] * b
    if k_full:
        lk = [max(max(lk), max(lq))] * b
    return lq, lk


def _ivec(xs, dev="cuda"):
    return torch.tensor(xs, device=dev, dtype=torch.int32)


def _cu(xs):
    return _ivec([0] + list(torch.tensor(xs).cumsum(0).tolist()))


def build(case, lse, rng):
    """-> (kwargs for flash_attn_varlen_func / flash_attn_func, entry, reference (out, lse) in
    the call's own layout, a mask of valid output rows in that layout, lse wanted)."""
    name, qf, kvf, phase, ex = case
    hq, hk, d = ex.get("hq", 16), ex.get("hk", 4), ex.get("d", 128)
    dt = torch.bfloat16
    b = ex.get("batch", 5 if phase == "prefill" else 4)
    lq, lk = _lengths(rng, b, phase, qf == "batch", kvf == "batch")
    sq_max, sk_max = max(max(lq), 1), max(max(lk), 1)
    qp = torch.randn(b, sq_max, hq, d, device="cuda", dtype=dt)
    kp = torch.randn(b, sk_max, hk, d, device="cuda", dtype=dt)
    vp = torch.randn(b, sk_max, hk, d, device="cuda", dtype=dt)
    kw = dict(causal=True, return_lse=lse, softcap=ex.get("softcap", 0.0))
    if "pack_gqa" in ex:
        kw["pack_gqa"] = ex["pack_gqa"]
    if ex.get("window"):
        kw["window_size"] = (ex["window"], 0)
    sink = None
    if ex.get("sink"):
        sink = torch.randn(hq, device="cuda").to(getattr(torch, ex["sink"]))
        kw["learnable_sink"] = sink

    # q
    if qf.startswith("batch"):
        q = qp
        if qf == "batch+seqused":
            kw["seqused_q"] = _ivec(lq)
        valid = torch.arange(sq_max, device="cuda")[None, :] < _ivec(lq)[:, None]  # (b, sq)
    else:
        # packed: sequence i owns rows cu[i]..cu[i+1]; with seqused, some slack rows follow it
        slack = [rng.randint(0, 3) if qf == "packed+seqused" else 0 for _ in range(b)]
        own = [n + s for n, s in zip(lq, slack)]
        cu = _cu(own)
        q = torch.randn(int(sum(own)), hq, d, device="cuda", dtype=dt)
        valid = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
        for i, n in enumerate(lq):
            at = int(cu[i])
            qp[i, :n] = q[at : at + n]
            valid[at : at + n] = True
        kw.update(cu_seqlens_q=cu, max_seqlen_q=sq_max)
        if qf == "packed+seqused":
            kw["seqused_q"] = _ivec(lq)

    # K/V
    if kvf.startswith("batch"):
        k, v = kp, vp
        if kvf == "batch+seqused":
            kw["seqused_k"] = _ivec(lk)
    elif kvf.startswith("packed"):
        slack = [rng.randint(0, 5) if kvf == "packed+seqused" else 0 for _ in range(b)]
        own = [n + s for n, s in zip(lk, slack)]
        cu = _cu(own)
        k = torch.randn(int(sum(own)), hk, d, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        for i, n in enumerate(lk):
            at = int(cu[i])
            kp[i, :n], vp[i, :n] = k[at : at + n], v[at : at + n]
        kw.update(cu_seqlens_k=cu, max_seqlen_k=sk_max)
        if kvf == "packed+seqused":
            kw["seqused_k"] = _ivec(lk)
    else:  # paged+seqused
        page = ex["page"]
        k, v, table = paged_kv(kp, vp, lk, page, shuffle=True, spare=2)
        kw.update(page_table=table, seqused_k=_ivec(lk), max_seqlen_k=sk_max)

    lqt, lkt = torch.tensor(lq, device="cuda"), torch.tensor(lk, device="cuda")
    ro, rl = attention_ref(
        qp, kp, vp, lqt, lkt, causal=True, window_left=ex.get("window"), sink=sink,
        softcap=ex.get("softcap") or None,
    )
    ro = ro.to(dt).float()
    if qf.startswith("batch"):
        ref_out, ref_lse = ro, rl  # (b, sq, hq, dv), (b, hq, sq)
    else:
        ref_out = torch.zeros(q.shape[0], hq, d, device="cuda")
        ref_lse = torch.zeros(hq, q.shape[0], device="cuda")
        cu = kw["cu_seqlens_q"]
        for i, n in enumerate(lq):
            at = int(cu[i])
            ref_out[at : at + n] = ro[i, :n]
            ref_lse[:, at : at + n] = rl[i, :, :n]
    entry = "flash_attn_func" if (qf == "batch" and kvf == "batch") else "flash_attn_varlen_func"
    return kw, (q, k, v), entry, (ref_out, ref_lse), valid, lse


def _check(out, lse_out, ref, valid, want_lse, tag):
    ref_out, ref_lse = ref
    o, r = out[valid].float(), ref_out[valid]
    assert not torch.isnan(o).any(), f"{tag}: NaN in a valid output row (unwritten?)"
    if r.numel():
        err = rel_err(o, r)
        assert err < TOL, f"{tag}: rel err {err:.3e}"
    if not want_lse:
        assert lse_out is None
        return
    # lse: (b, hq, sq) for batch-form q, (hq, total_q) packed; valid is (b, sq) / (total_q,)
    lv = lse_out.transpose(1, 2)[valid] if lse_out.dim() == 3 else lse_out.t()[valid]
    rv = ref_lse.transpose(1, 2)[valid] if ref_lse.dim() == 3 else ref_lse.t()[valid]
    fin = torch.isfinite(rv)
    assert torch.equal(torch.isfinite(lv), fin), f"{tag}: LSE -inf pattern differs"
    if fin.any():
        lerr = ((lv[fin] - rv[fin]).abs().max() / rv[fin].abs().max().clamp_min(1)).item()
        assert lerr < LSE_TOL, f"{tag}: LSE err {lerr:.3e}"


@pytest.mark.parametrize("lse", [False, True], ids=["", "lse"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_runtime(case, lse):
    import fa4aot

    rng = random.Random(SEED ^ zlib.crc32(case[0].encode()))
    kw, (q, k, v), entry, ref, valid, want_lse = build(case, lse, rng)
    out_shape = q.shape
    if q.dim() == 4:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    kw["out"] = torch.full(out_shape, float("nan"), device="cuda", dtype=q.dtype)
    if want_lse:
        kw["lse"] = torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)
    out, lse_out = getattr(fa4aot, entry)(q, k, v, **kw)
    assert out.data_ptr() == kw["out"].data_ptr()
    _check(out, lse_out, ref, valid, want_lse, f"{case[0]} seed {SEED}")


@pytest.fixture(scope="module")
def installed():
    pytest.importorskip("flash_attn.cute")
    import fa4aot

    counters = fa4aot.install(on_miss="error")
    yield counters
    fa4aot.uninstall()


@pytest.mark.parametrize("lse", [False, True], ids=["", "lse"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_install(case, lse, installed):
    """The same call through FA4's own interface, served by install(on_miss="error")."""
    import flash_attn.cute as fa

    rng = random.Random(SEED ^ zlib.crc32(case[0].encode()) ^ 1)
    kw, (q, k, v), entry, ref, valid, want_lse = build(case, lse, rng)
    before = installed.compiles
    out, lse_out = getattr(fa, entry)(q, k, v, **kw)
    assert installed.compiles == before == 0, "FA4 compiled under install(on_miss='error')"
    if not want_lse:
        lse_out = None
    _check(out, lse_out, ref, valid, want_lse, f"install {case[0]} seed {SEED}")
