"""Stand-ins shared by the CPU tests: FA4's kernels as torch code computing what FA4 computes
(the runtime calls them through the same ABI it calls the real ones with), and call builders.

- dense_ref_kernel: FA4's sm90 dense forward (fp32 reference attention, reference.py);
- write_ref: the same arithmetic for stand-ins of other ABIs (sm100, FP8) to call;
- fake_fwd / fake_combine / fake_chunk_meta / fake_packed_meta: the split-KV chunk kernel in its
  chunk modes (fa4.forwards.trace_chunk_modes), FA4's combine, fa4aot's metadata kernels;
- call / fold_kernel: a decode Call and the decode-fold kernel's Variant.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from reference import attention_ref

from fa4aot.model.compile_keys import Call

ARCH = "sm90"


def write_ref(q, k, v, out, lse, *, causal, scale, sink=None) -> None:
    """Write the fp32 reference of a dense-q, dense-K call into `out` (and `lse` if given)."""
    b, sq = q.shape[:2]
    o, lse_ = attention_ref(q, k, v, torch.full((b,), sq), torch.full((b,), k.shape[1]),
                            causal=causal, sink=sink, scale=scale)
    out.copy_(o)
    if lse is not None:
        lse.copy_(lse_)


def dense_ref_kernel(causal: bool):
    """A dense-q, dense-K forward in FA4's sm90 argument order (reference attention)."""

    def fwd(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, pt, wl, wr, sink, *rest):
        assert cu_q is cu_k is used_q is used_k is pt is None
        write_ref(q, k, v, out, lse, causal=causal, scale=scale, sink=sink)

    return fwd


def fake_fwd(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, pt, wl, wr, sink, bs, aux,
             cu_total, cu_splits, chunk_lengths=False):
    """FA4's 1:1 non-causal kernel, q in batch form (B, M, H, d), K packed (cu_seqlens_k, with
    seqused_k: each sequence's first key and keys) or paged (page_table + seqused_k); empty sequences give out 0 and lse -inf. In the chunk
    modes of forwards.trace_chunk_modes: sequence s reads q[s // (B / q's batch)] and, with
    chunk_lengths, sees clamp(used_k[s // u] - (s % u) * c, 0, c) keys, u = B / used_k's
    count, c = the page table's columns * page size (else used_k holds one length a row)."""
    assert cu_q is None and used_q is None and sink is None and wl is None and wr is None
    B, M, H, d = out.shape[:3] + q.shape[-1:]
    per_q = B // q.shape[0]
    if pt is not None and not chunk_lengths:
        assert used_k.shape == (B,)
    for s in range(B):
        if pt is not None:
            u, c = B // used_k.shape[0], pt.shape[1] * k.shape[1]
            n = min(max(int(used_k[s // u]) - (s % u) * c, 0), c)
            kk = k[pt[s].long()].reshape(-1, H, d)[:n]
            vv = v[pt[s].long()].reshape(-1, H, v.shape[-1])[:n]
        elif cu_k.dim() == 5:  # forwards.trace_chunk_modes(bounds=True): (b + 1, R, c, K, A)
            b1, rows, c, shift, anchor = cu_k.shape
            u, last = B // ((b1 - 1) * rows), b1 - 1
            r, j = s // u, s % u
            i, t = r // rows, r % rows
            start, nxt = int(cu_k[i, 0, 0, 0, 0]), int(cu_k[min(i + 1, last), 0, 0, 0, 0])
            skip = max(nxt - start - anchor + 1, 0) if anchor > 1 else 0
            a = min(start + skip + j * c, nxt)
            n = min(max(nxt - start - max(shift - 1 - t, 0) - skip - j * c, 0), c)
            kk, vv = k[a:a + n], v[a:a + n]
        else:  # a packed K: cu_seqlens_k bounds, or (with seqused_k) first keys
            a = int(cu_k[s])
            e = a + int(used_k[s]) if used_k is not None else int(cu_k[s + 1])
            kk, vv = k[a:e], v[a:e]
        if kk.shape[0] == 0:
            out[s] = 0
            lse[s] = float("-inf")
            continue
        sc = torch.einsum("mhd,nhd->hmn", q[s // per_q].float(), kk.float()) * scale
        lse[s] = torch.logsumexp(sc, -1)
        out[s] = torch.einsum("hmn,nhd->mhd", torch.softmax(sc, -1), vv.float()).to(out.dtype)


def fake_combine(op, lp, out, lse, *rest):
    """FA4's combine, batched: op (N, B, S, H, D), lp (N, B, S, H) -> out (B, S, H, D), lse."""
    assert all(x is None for x in rest)
    assert op.dtype in (torch.bfloat16, torch.float16)  # the chunk kernel's own partials
    assert op.stride(-1) == 1 and lp.stride(2) == 1  # the modes FA4's combine takes contiguous
    m = lp.max(0).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lp - m)
    tot = w.sum(0)
    lse.copy_(torch.where(tot > 0, torch.log(tot) + m, torch.full_like(m, float("-inf"))))
    o = (w[..., None] * op.float()).sum(0) / tot.clamp_min(1e-30)[..., None]
    out.copy_(o.to(out.dtype))


def fake_chunk_meta(lengths: bool):
    """kernels.trace_chunk_meta's kernel of one form, in torch (its docstring's arithmetic):
    lengths (paged K) or bounds (packed K)."""

    def meta(src, dst, chunk, slots, rows, causal):
        if lengths:  # dst (b, rows * slots)
            t = torch.arange(dst.shape[1])
            r = t // slots
            off = (t - r * slots) * chunk + ((rows - 1 - r) if causal else 0)
            dst.copy_((src[:, None] - off[None]).clamp(0, chunk))
        else:  # dst (b + 1, slots)
            bound = src[:, None] + torch.arange(dst.shape[1])[None] * chunk
            bound[:-1] = torch.minimum(bound[:-1], src[1:, None])
            dst.copy_(bound)

    return meta


def fake_packed_meta(used, table, used_a, tail_table, tail_len, rows, page):
    """kernels.trace_packed_meta's kernel in torch (its docstring's arithmetic)."""
    x = used.long() - (rows - 1)
    t_used = x.clamp(min=0) // page * page
    used_a.copy_(t_used)
    cols = (t_used // page)[:, None] + torch.tensor([0, 1])
    pages = table.long().gather(1, cols.clamp(max=table.shape[1] - 1))
    tail_table.copy_(pages.repeat_interleave(rows, 0))
    tail_len.copy_(((x - t_used)[:, None] + torch.arange(rows)).clamp(min=0).flatten())


def call(hq=20, hk=1, d=128, layout="dense", sq=1, page=None, lse=False, causal=True):
    return Call(
        layout=layout,
        batch=4,
        seqlen_q=sq,
        seqlen_k=256,
        num_heads=hq,
        num_heads_kv=hk,
        head_dim=d,
        head_dim_v=d,
        dtype="bfloat16",
        causal=causal,
        window_left=None,
        window_right=None,
        return_lse=lse,
        sink_dtype=None,
        page_size=page,
    )


def fold_kernel(layout="dense", d=128, lse=False, page=None, ratio=1):
    """A decode-fold kernel: non-causal, q in batch form for varlen / paged K."""
    c = call(hq=ratio, d=d, layout=layout, page=page, lse=lse, causal=False)
    return replace(c, batch_q=layout != "dense").variant(ARCH)


def fake_ragged_meta(lengths, table, q, qv, out_v, table_v, first, n, align, page, rows,
                     causal):
    """kernels.trace_ragged's metadata kernel in torch: policy/ragged.entry_map's map written
    as the kernel writes it (paged: each entry's keys and its 128-key tiles' page-table
    columns; packed: the entries' bounds; packed with seqused_k: each entry's first key and
    keys), its q rows copied into qv (entry, row, KV head, group, d): every row for a body
    entry, its own for a tail entry."""
    from fa4aot.policy.ragged import Ragged, entry_map

    paged = table is not None and table.dim() == 2
    used = table is not None and table.dim() == 1  # (lengths: seqused_k, table: cu_seqlens_k)
    lens = lengths.tolist() if paged or used else (lengths[1:] - lengths[:-1]).tolist()
    lens = [max(x, 0) for x in lens]
    rg = Ragged(n, qv.shape[0], align, table_v.shape[1] if paged else 0, rows)  # (used: 1 col)
    f, entries, _ = entry_map(lens, rg, page if paged else None, bool(causal))
    first.copy_(torch.tensor(f, dtype=first.dtype))
    hk, r = qv.shape[2], qv.shape[3]
    for v, (i, t, start, keys) in enumerate(entries):
        if i < 0:
            out_v[v] = 0 if paged or used else lengths[-1]
            if used:
                table_v[v, 0] = 0
            continue
        for tt in range(rows) if t < 0 else [t]:
            qv[v, tt] = q[i * rows + tt].view(hk, r, -1)
        if paged:
            out_v[v] = keys
            cols = min(-(-keys // 128) * 128 // page, table_v.shape[1])
            for c in range(cols):
                table_v[v, c] = table[i, min(start // page + c, table.shape[1] - 1)]
        elif used:
            out_v[v], table_v[v, 0] = table[i] + start, keys
        else:
            out_v[v] = lengths[i] + start
    if not paged and not used:
        out_v[-1] = lengths[-1]


def fake_ragged_merge(op, lp, first, sink, out, lse, rows, tail):
    """kernels.trace_ragged's merge in torch: decode row b = i * rows + t, query row m merges
    row m * rows + t of sequence i's body entries, first[i] .. first[i + 1] - tail - 1, and
    (tail > 0) of its tail entry first[i + 1] - tail + t, of op (E, M * rows, H, D) / lp (E, M
    * rows, H) by LSE, sink (M, H) one more LSE term with no output; out (B, M, H, D), lse
    (B, M, H)."""
    m = out.shape[1]
    for b in range(out.shape[0]):
        i, t = divmod(b, rows)
        s0, s1 = int(first[i]), int(first[i + 1])
        nb = max(s1 - s0 - tail, 0)
        idx = list(range(s0, s0 + nb)) + ([s0 + nb + t] if tail else [])
        mr = torch.arange(m) * rows + t
        lps, ops = lp[idx][:, mr], op[idx][:, mr]
        terms = torch.cat([lps.float(), sink[None].float()])
        tot = torch.logsumexp(terms, 0)
        lse[b] = tot
        w = torch.exp(lps - tot).nan_to_num(0.0)
        out[b] = (w[..., None] * ops.float()).sum(0).to(out.dtype)
