"""The GPU tests' fp32 reference (tests/reference.py) on the CPU: computed one sequence at a
time above a size (so b16 over 64K keys fits an 80 GB card), it gives what it gives at once, to
fp32 rounding (the CPU's matmuls block a batch of one differently: 2e-7 apart here, on 2 cores;
the GPU tests' tolerances are 1e-2)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import reference as R  # noqa: E402


def test_one_sequence_at_a_time_gives_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(0)
    b, sq, hq, hk, d, sk = 3, 2, 8, 2, 16, 50
    q = torch.randn(b, sq, hq, d, generator=g)
    k, v = torch.randn(b, sk, hk, d, generator=g), torch.randn(b, sk, hk, d, generator=g)
    lq, lk = torch.tensor([2, 1, 2]), torch.tensor([50, 7, 0])
    sink = torch.randn(hq, generator=g)
    for kw in (dict(causal=True, sink=sink), dict(causal=False, window_left=5)):
        o1, l1 = R.attention_ref(q, k, v, lq, lk, **kw)
        monkeypatch.setattr(R, "_BATCH_AT_ONCE_BYTES", 0)
        o2, l2 = R.attention_ref(q, k, v, lq, lk, **kw)
        monkeypatch.undo()
        assert o1.shape == o2.shape == (b, sq, hq, d) and l1.shape == l2.shape == (b, hq, sq)
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6, equal_nan=True)
        # sequence 2 has no keys: lse -inf, or the sink's where one is given
        assert (torch.isfinite(l1[2]) if "sink" in kw else torch.isinf(l1[2])).all()


def test_paged_kv_reads_back_each_sequence_through_its_table():
    g = torch.Generator().manual_seed(1)
    lens, page, hk, d, dv = [0, 5, 16, 33], 16, 2, 8, 4
    k = torch.randn(len(lens), max(lens), hk, d, generator=g)
    v = torch.randn(len(lens), max(lens), hk, dv, generator=g)
    for shuffle in (False, True):
        kp, vp, table = R.paged_kv(k, v, lens, page, shuffle=shuffle, spare=2, extra_cols=1)
        assert kp.shape == (1 + 1 + 1 + 3 + 2, page, hk, d) and vp.shape[-1] == dv
        assert table.dtype == torch.int32 and table.shape == (len(lens), 3 + 1)
        used = sorted(int(p) for i, n in enumerate(lens) for p in table[i, : max(1, -(-n // page))])
        assert len(set(used)) == len(used)  # no page shared between sequences
        for i, n in enumerate(lens):
            pages = table[i, : max(1, -(-n // page))].long()
            assert torch.equal(kp[pages].reshape(-1, hk, d)[:n], k[i, :n])
            assert torch.equal(vp[pages].reshape(-1, hk, dv)[:n], v[i, :n])
