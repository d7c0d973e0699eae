"""Ratio padding for absorbed-MLA (qv) calls, on the CPU: the chosen ratio, and that padding
each latent group's query heads with zeros, attending, and cropping O and LSE gives the fp32
reference of the unpadded call (no GPU: the reference stands in for FA4's kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from fa4aot.policy.select import crop_heads, mla_padded_ratio, mla_ratio_ok, pad_heads


def test_ratios_fa4_runs_and_the_padding_chosen():
    assert [r for r in range(1, 33) if mla_ratio_ok(r)] == [1, 2, 4, 8, 16, 32]
    assert mla_padded_ratio(16) == (16, 1.0)
    assert mla_padded_ratio(20) == (32, 1.6) and mla_padded_ratio(10) == (16, 1.6)
    assert mla_padded_ratio(5) == (8, 1.6)
    assert mla_padded_ratio(20, available=[16, 64, 32, 24]) == (32, 1.6)  # 24: FA4 refuses it
    assert mla_padded_ratio(20, available=[64]) == (64, 3.2)
    with pytest.raises(LookupError, match="divides 128"):
        mla_padded_ratio(20, available=[16, 24])


def _mla_ref(q, qv, k, v, causal: bool):
    """Absorbed MLA, fp32: scores = q.k + qv.v (rope + latent), softmax scale 1/sqrt(64 + 512)
    (FA4's default with qv), O = P.v; q/qv (b, s_q, h, .), k/v (b, s_k, 1, .); O (b, s_q, h, dv),
    LSE (b, s_q, h) (FA4's qv layout: heads last)."""
    scale = 1.0 / math.sqrt(q.shape[-1] + qv.shape[-1])
    s = (torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) + torch.einsum("bqhd,bkd->bhqk", qv, v[:, :, 0]))
    s = s * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (b, h, q)
    o = torch.einsum("bhqk,bkd->bqhd", torch.softmax(s, -1), v[:, :, 0])
    return o, lse.permute(0, 2, 1)


@pytest.mark.parametrize("ratio, causal, sq", [(20, True, 1), (10, True, 3), (5, False, 4)])
def test_pad_attend_crop_equals_the_unpadded_reference(ratio, causal, sq):
    g = torch.Generator().manual_seed(ratio * 7 + sq)
    b, sk, d, dv = 2, 37, 64, 512
    q = torch.randn(b, sq, ratio, d, generator=g)
    qv = torch.randn(b, sq, ratio, dv, generator=g)
    k = torch.randn(b, sk, 1, d, generator=g)
    v = torch.randn(b, sk, 1, dv, generator=g)
    r2, _ = mla_padded_ratio(ratio)
    o_pad, lse_pad = _mla_ref(pad_heads(q, ratio, r2), pad_heads(qv, ratio, r2), k, v, causal)
    assert o_pad.shape[-2] == r2
    o = crop_heads(o_pad, ratio, r2)
    lse = crop_heads(lse_pad, ratio, r2, head_dim=-1)
    o_ref, lse_ref = _mla_ref(q, qv, k, v, causal)
    # heads are independent, but the CPU's GEMM blocks the einsum by the head count, so scores
    # of 576-term dot products round differently at 20 and 32 heads (a CI run: LSE 4e-5 apart);
    # a misplaced head or group would differ by O(1)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-4)


def test_padding_keeps_groups_apart_with_several_kv_heads():
    x = torch.arange(2 * 9 * 4, dtype=torch.float32).reshape(2, 9, 4)
    p = pad_heads(x, 3, 4, num_kv=3)
    assert p.shape == (2, 12, 4)
    assert torch.equal(p[:, 3], torch.zeros(2, 4)) and torch.equal(p[:, 4], x[:, 3])
    assert torch.equal(crop_heads(p, 3, 4, num_kv=3), x)


def test_explain_shows_the_mla_padding(tmp_path):
    import json

    from click.testing import CliRunner

    from fa4aot.cli import main

    args = ["explain", "--heads", "20:1", "--head-dim", "64", "--qv", "512", "--json",
            "--cache", str(tmp_path)]
    r = CliRunner().invoke(main, ["explain", "--arch", "sm100", *args[1:]])
    assert r.exit_code == 1, r.output  # an empty cache serves nothing
    doc = json.loads(r.stdout)
    assert (doc["ratio"], doc["padded_ratio"], doc["cost"], doc["problems"]) == (20, 32, 1.6, [])
    assert "2CTA MLA kernel" in doc["fa4_refuses"] and doc["choices"] == []
    r = CliRunner().invoke(main, args)  # sm90: refused, with the reason
    assert r.exit_code == 1 and "sm100-only" in json.loads(r.stdout)["problems"][0]
    r = CliRunner().invoke(main, ["explain", "--arch", "sm100", "--no-padding", *args[1:]])
    assert r.exit_code == 1 and "--no-padding refuses it" in json.loads(r.stdout)["problems"][0]
    r = CliRunner().invoke(main, ["explain", "--arch", "sm100", "--layout", "dense", *args[1:]])
    assert r.exit_code == 1 and "take q packed" in json.loads(r.stdout)["problems"][0]


def _with_store(monkeypatch, variants):
    """explain's view of the stores: artifacts holding exactly `variants`."""
    from types import SimpleNamespace

    from fa4aot.cli import explain as E

    arts = [SimpleNamespace(id=v.id, record={"variant": v.to_dict()}) for v in variants]
    match = SimpleNamespace(stores=[], describe_others=lambda: "none")
    monkeypatch.setattr(E, "_cached_artifacts", lambda *a: (arts, {}, match))


def test_explain_shows_the_runtimes_mla_plan_from_the_store(tmp_path, monkeypatch):
    """The plan the runtime takes (runtime/mla.py; tests/runtime/test_mla_runtime.py runs it): the
    padded ratio's cached kernel for a 2CTA call, FA4's 1CTA kernel at ratio 20 for a decode
    step past one wave of 2CTA clusters."""
    import json

    from click.testing import CliRunner

    from fa4aot.build.builder import plan_for
    from fa4aot.cli import main
    from fa4aot.model.specs import load_default

    stored = [n.variant for n in plan_for([load_default("glm-4.7-flash")], "sm100")
              .variants().values()]  # fmt: skip
    _with_store(monkeypatch, stored)
    base = ["explain", "--arch", "sm100", "--heads", "20:1", "--head-dim", "64", "--qv", "512",
            "--cache", str(tmp_path)]  # fmt: skip
    r = CliRunner().invoke(main, [*base, "--seqlen-q", "4", "--lse", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["variant"] is None and "2CTA MLA kernel" in doc["fa4_refuses"]
    assert doc["split"]["splits"] == 0 and "runs unsplit" in doc["split"]["why"]
    (best, *_) = doc["choices"]
    assert (best["ratio"], best["cost"], best["exact"]) == (32, 1.6, False)
    served = {v.id: v for v in stored}[best["id"]]
    assert (served.mla, served.qhead_per_kvhead, served.return_lse) == ("2cta", 32, True)
    text = CliRunner().invoke(main, [*base, "--seqlen-q", "4", "--lse"]).output
    assert "served by   : padded (q heads per KV head 20 -> 32; 1.60x the work)" in text
    # one-row decode at batch 200 > 148 / 2: FA4's 1CTA kb64 kernel takes ratio 20 as is
    r = CliRunner().invoke(main, [*base, "--batch", "200", "--layout", "paged", "--page-size",
                                  "128", "--json"])  # fmt: skip
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["fa4_refuses"] is None
    assert doc["variant"]["mla"] == "1cta-kb64" and doc["choices"][0]["exact"]
