"""fp32 attention reference for GPU tests: padded batch, bottom-right causal, window, sinks."""

from __future__ import annotations

import math

import torch


_BATCH_AT_ONCE_BYTES = 2 << 30


def attention_ref(
    q, k, v, lq, lk, *, causal, window_left=None, sink=None, scale=None, softcap=None
):
    """q (b, Sq, hq, d), k/v (b, Sk, hk, d[v]) zero-padded; lq/lk lengths (b,) long.

    Returns out (b, Sq, hq, dv) fp32 and lse (b, hq, Sq) fp32 (natural log, sink included).
    Rows with no visible key give out 0 and lse -inf (or the sink). softcap: FA4's tanh capping
    of the scaled scores, softcap * tanh(s / softcap).
    """
    b, Sq, hq, d = q.shape
    hk = k.shape[2]
    if b > 1 and k.shape[1] * hq * max(d, v.shape[-1]) * 4 * b > _BATCH_AT_ONCE_BYTES:
        # one sequence at a time: K and V in fp32 over every query head fit an 80 GB card
        # (b16 over 64K keys at 32 heads: 16 GiB each at once)
        outs = [attention_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], lq[i:i + 1], lk[i:i + 1],
                              causal=causal, window_left=window_left, sink=sink, scale=scale,
                              softcap=softcap) for i in range(b)]
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    kf = k.float().repeat_interleave(hq // hk, 2)
    vf = v.float().repeat_interleave(hq // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device)[None, :, None] + (lk - lq)[:, None, None]  # (b, Sq, 1)
    j = torch.arange(k.shape[1], device=q.device)[None, None, :]
    mask = (j >= lk[:, None, None]) | (
        torch.arange(Sq, device=q.device)[None, :, None] >= lq[:, None, None]
    )
    if causal:
        mask = mask | (j > i)
    if window_left is not None:
        mask = mask | (j < i - window_left)
    s = s.masked_fill(mask[:, None], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.float()[None, :, None, None].expand(b, hq, Sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out, lse


def rel_err(out, ref) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def pad_ragged(x, cu, lengths, max_len):
    """(total, h, d) packed by cu -> (b, max_len, h, d) zero-padded."""
    b = len(lengths)
    out = x.new_zeros(b, max(max_len, 1), *x.shape[1:])
    for i in range(b):
        n = lengths[i]
        if n:
            out[i, :n] = x[cu[i] : cu[i] + n]
    return out


def unpad(x, cu, lengths):
    """(b, max_len, ...) -> (total, ...)."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)], 0) if lengths else x[:0, 0]


def mla_ref(q, qv, ks, vs, cu_q, *, causal, scale=None):
    """Absorbed MLA, fp32: q (total_q, h, dr) rope part and qv (total_q, h, dl) latent part
    packed by cu_q (host ints, batch + 1); ks[i] (n_i, dr) / vs[i] (n_i, dl): sequence i's one
    latent K/V head. Scores q.k + qv.v times `scale` (default 1/sqrt(dr + dl), FA4's with qv),
    bottom-right causal. Returns out (total_q, h, dl) and lse (total_q, h) (FA4's qv layout,
    heads last); a row with no visible key gives out 0 and lse -inf."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1] + qv.shape[-1])
    h, dl = q.shape[1], qv.shape[-1]
    out = torch.zeros(q.shape[0], h, dl)
    lse = torch.full((q.shape[0], h), float("-inf"))
    for i in range(len(cu_q) - 1):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        k, v = ks[i].float(), vs[i].float()
        sq, sk = b - a, k.shape[0]
        if sq == 0 or sk == 0:
            continue
        s = torch.einsum("qhd,kd->hqk", q[a:b].float(), k)
        s = (s + torch.einsum("qhd,kd->hqk", qv[a:b].float(), v)) * scale
        if causal:
            visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
            s = s.masked_fill(~visible, float("-inf"))
        li = torch.logsumexp(s, -1)  # (h, sq)
        p = torch.exp(s - li[..., None]).nan_to_num(0.0)
        out[a:b] = torch.einsum("hqk,kd->qhd", p, v)
        lse[a:b] = li.t()
    return out, lse


def paged_kv(k, v, lens, page, *, shuffle=False, spare=0, extra_cols=0):
    """K/V in batch form (b, sk, hk, d[v]), sequence i's first lens[i] keys, as a page pool:
    -> (k pool (pages, page, hk, d), v pool, table (b, cols) int32). Each sequence takes
    ceil(len / page) pages (at least one) in pool order, or in a random order with `shuffle`
    (and random values in every slot no key fills: what a kernel must never read); the pool
    has `spare` pages more, the table `extra_cols` columns more."""
    b, _, hk, d = k.shape
    npg = [max(1, -(-n // page)) for n in lens]
    pool = sum(npg) + spare
    make = torch.randn if shuffle else torch.zeros
    kpool = make(pool, page, hk, d, dtype=k.dtype, device=k.device)
    vpool = make(pool, page, hk, v.shape[-1], dtype=v.dtype, device=v.device)
    order = torch.randperm(pool, device=k.device) if shuffle else torch.arange(pool)
    table = torch.zeros(b, max(npg) + extra_cols, dtype=torch.int32, device=k.device)
    at = 0
    for i, (n, length) in enumerate(zip(npg, lens)):
        pages = order[at : at + n].to(device=k.device)
        table[i, :n] = pages.to(torch.int32)
        at += n
        if length:
            ks = kpool[pages].reshape(n * page, hk, d)
            vs = vpool[pages].reshape(n * page, hk, v.shape[-1])
            ks[:length], vs[:length] = k[i, :length], v[i, :length]
            kpool[pages], vpool[pages] = ks.view(n, page, hk, d), vs.view(n, page, hk, -1)
    return kpool, vpool, table
