"""abi's sm100 lists against really compiled kernels (three CPU cross-compiles, 30-45 s).

tests/runtime/test_abi.py compares abi with the calls FA4 makes (compile stubbed). Here FA4 compiles
for real (sm_100a, no GPU), and the compiled function itself is asked: its run-time signature
(what `export_to_c` exports and tvm-ffi calls) must be abi's table, slot for slot, and the
slots it was compiled with None in (folded into the kernel: a tensor there is refused) must be
exactly the slots abi's list leaves None for that call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
sys.path.insert(0, sys.argv[1])
import test_abi as T
from fa4aot.fa4 import driver
from fa4aot.runtime import abi
driver.configure("sm100", 148)
_, I = driver._fa4()
base = dict(batch=2, seqlen_q=3, seqlen_k=256, num_heads=4, num_heads_kv=1, head_dim=128,
            head_dim_v=128, dtype="bfloat16", causal=True, window_left=None, window_right=None,
            return_lse=True, sink_dtype=None)
cases = [
    dict(base, layout="varlen"),  # packed q and K, causal, LSE
    dict(base, layout="paged", page_size=128, batch_q=True, return_lse=False, causal=False,
         sink_dtype="float32", window_left=64, window_right=0),
    dict(base, layout="varlen", batch=1, seqlen_q=1, seqlen_k=1024, num_heads=16,  # MLA 2CTA
         head_dim=64, head_dim_v=512, qv=True),
]
out = []
for c in cases:
    I._flash_attn_fwd.compile_cache.clear()
    with FakeTensorMode():
        inp, kw = T._case_inputs(c)
        args = {n: inp[n] for n in T._FWD_TENSORS if n in inp}
        I._flash_attn_fwd(inp["q"], inp["k"], inp["v"], **args, **kw)
        ((key, fn),) = I._flash_attn_fwd.compile_cache.cache.items()
        calls, _ = T._abi_calls("sm100", c, inp, kw, key)
    fwd = next(a for k, a in calls if k == "fwd")
    ea = fn.execution_args
    out.append({
        "kernel": type(fn).__name__,
        "params": list(ea.signature.parameters),
        # (the DSL writes "unknown" where it did not record the compile arguments)
        "compiled_with_none": [x if isinstance(x, bool) else repr(x)
                               for x in ea._compiled_with_none],
        "abi_none": [a is None for a in fwd],
        "mla": "qv" in inp,
    })
print(json.dumps(out))
"""


@pytest.mark.slow
def test_compiled_sm100_kernels_take_abis_lists():
    from fa4aot.runtime import abi
    from test_abi import _ALIASES

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    here = str(Path(__file__).resolve().parent)  # test_abi beside this file
    r = subprocess.run([sys.executable, "-c", _SCRIPT, here], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [g["mla"] for g in got] == [False, False, True]
    for g in got:
        table = abi.SM100_MLA_FWD if g["mla"] else abi.SM100_FWD
        assert g["params"][-1] == "stream"  # tvm-ffi's environment stream: not an argument
        assert tuple(_ALIASES.get(p, p) for p in g["params"][:-1]) == table
        # the None slots of abi's list are exactly those the kernel was compiled with None in
        # (aux data is a tuple, descales None unless FP8: both as FA4 passes them)
        assert g["compiled_with_none"][:-1] == g["abi_none"], g
        assert 0 < sum(g["abi_none"]) < len(table)
