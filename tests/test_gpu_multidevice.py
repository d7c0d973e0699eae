"""Any CUDA device (issue 13; marker `gpu`, needs 2 GPUs, e.g. the device tool's nvidia-h200-x2).

A call on cuda:N must run on cuda:N's current stream, with cuda:N's arch, SM count and
artifacts, whatever the current device is. Checked two ways, over the default specs' store:
- one process driving both GPUs, with the *other* GPU current, interleaving devices so an
  artifact first loaded for one device is then called on the other; and a side stream on
  cuda:1 that the inputs are written on after a long sleep (a kernel launched on any other
  stream would read the NaN-poisoned inputs before the copy);
- one process per GPU (as torchrun starts them: every rank sees both GPUs and uses
  cuda:<rank>), run as two concurrent subprocesses of this file.
Every case: fresh random inputs, NaN-poisoned `out=`, fp32 reference. Includes a split-KV
decode (long context at batch 1: scratch buffers per device and stream).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))
from reference import attention_ref, paged_kv, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2
HQ, HK, D = 32, 8, 128  # llama-3.1-8b's attention: in the default store (dense, varlen, paged)


def _two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")


def _ref_check(q, k, v, out, lq, lk, tag):
    lqt = torch.as_tensor(lq, device=q.device)
    lkt = torch.as_tensor(lk, device=q.device)
    ro, _ = attention_ref(q, k, v, lqt, lkt, causal=True)
    got = out.float()
    assert not torch.isnan(got).any(), f"{tag}: NaN in output"
    err = rel_err(got, ro.to(q.dtype).float())
    assert err < TOL, f"{tag}: rel err {err:.3e}"
    return err


def run_cases(dev: torch.device, tag: str = "") -> list[str]:
    """Dense prefill, dense decode, split-KV decode, varlen and paged on `dev`."""
    import fa4aot

    dt = torch.bfloat16
    done = []
    for b, sq, sk in [(2, 300, 300), (4, 1, 2000), (1, 1, 65536)]:
        q = torch.randn(b, sq, HQ, D, device=dev, dtype=dt)
        k = torch.randn(b, sk, HK, D, device=dev, dtype=dt)
        v = torch.randn_like(k)
        out = torch.full_like(q, float("nan"))
        fa4aot.flash_attn_func(q, k, v, causal=True, out=out)
        _ref_check(q, k, v, out, [sq] * b, [sk] * b, f"{tag} {dev} dense b{b} sq{sq} sk{sk}")
        done.append(f"dense b{b} sq{sq} sk{sk}")
    # varlen / paged decode: 3 sequences, reference on the padded batch
    lk = [37, 500, 1100]
    b = len(lk)
    q = torch.randn(b, HQ, D, device=dev, dtype=dt)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    kp = torch.zeros(b, max(lk), HK, D, device=dev, dtype=dt)
    vp = torch.zeros_like(kp)
    for page in (None, 64):
        if page is None:
            k = torch.randn(sum(lk), HK, D, device=dev, dtype=dt)
            v = torch.randn_like(k)
            cu_k = torch.tensor([0, 37, 537, 1637], device=dev, dtype=torch.int32)
            for i, n in enumerate(lk):
                kp[i, :n], vp[i, :n] = k[cu_k[i] : cu_k[i] + n], v[cu_k[i] : cu_k[i] + n]
            kw = dict(cu_seqlens_k=cu_k)
        else:
            for i, n in enumerate(lk):
                kp[i, :n], vp[i, :n] = torch.randn_like(kp[i, :n]), torch.randn_like(vp[i, :n])
            k, v, table = paged_kv(kp, vp, lk, page, shuffle=True, spare=1)
            kw = dict(page_table=table, seqused_k=torch.tensor(lk, device=dev, dtype=torch.int32))
        out = torch.full_like(q, float("nan"))
        fa4aot.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=max(lk), causal=True,
            out=out, **kw,
        )
        _ref_check(
            q[:, None], kp, vp, out[:, None], [1] * b, lk,
            f"{tag} {dev} {'paged' if page else 'varlen'} decode",
        )
        done.append(f"{'paged p64' if page else 'varlen'} decode")
    return done


def test_one_process_both_devices():
    _two_gpus()
    for rnd in range(2):
        for n in (1, 0):  # cuda:1 first: its artifacts are loaded before cuda:0 ever ran one
            with torch.cuda.device(1 - n):  # the other GPU is current
                run_cases(torch.device("cuda", n), f"round {rnd}, current cuda:{1 - n}")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


@pytest.mark.parametrize("sk", [2000, 65536])  # one kernel; split-KV (kernel + combine)
def test_side_stream_on_second_device(sk):
    """Inputs written on a side stream of cuda:1 after a long sleep: right answers only if
    fa4aot's kernels were enqueued on that stream, behind the copy."""
    _two_gpus()
    import fa4aot

    dev = torch.device("cuda", 1)
    dt = torch.bfloat16
    src = torch.randn(1, 1, HQ, D, device=dev, dtype=dt)
    q = torch.full_like(src, float("nan"))
    k = torch.randn(1, sk, HK, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize(dev)
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on cuda:1's side stream
        q.copy_(src)
        fa4aot.flash_attn_func(q, k, v, causal=True, out=out)
    s.synchronize()
    _ref_check(q, k, v, out, [1], [sk], f"side stream sk{sk}")


def test_one_process_per_device():
    _two_gpus()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{o[-3000:]}"
        assert f"rank {rank} ok" in o, o[-3000:]


if __name__ == "__main__":  # one rank of test_one_process_per_device
    rank = int(sys.argv[1])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    for rnd in range(3):
        done = run_cases(dev, f"rank {rank} round {rnd}")
    torch.cuda.synchronize(dev)
    print(f"rank {rank} ok: {', '.join(done)}")
