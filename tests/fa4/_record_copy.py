"""What _record_vllm.py and _record_sglang.py share: run an engine's FA4 copy (`_flash_attn_fwd`,
under FakeTensorMode) with `cute.compile` replaced by a recording stand-in and the copy's
`is_fake_mode` answered False, so it goes on to call what it "compiled"; lay the same call out
with fa4aot's (the script's `ours`); print one JSON object: per case the two call sequences in
one normal form (the one tests/runtime/test_abi.py compares too) and each compile key by field
name. `run` is the tests' side: one such subprocess, its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4aot.fa4 import sources
from fa4aot.fa4.keys import key_repr
from fa4aot.model.abis import ABIS, KeyFields

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


class S:
    """A named sentinel standing for one slot's value."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name

    def data_ptr(self):  # the sm90 launcher tests a page table's base (abi.GUARD_ALIGN):
        return 16  # off any mapping boundary, so the sentinel itself is passed on


def slot_names(args):
    return tuple(a.name if isinstance(a, S) else a for a in args)


def norm_seq(calls, inputs):
    """[(kind, args)] -> a comparable form: caller tensors named by the input they alias,
    other storages numbered in order of first appearance."""
    by_storage = {t.untyped_storage()._cdata: n for n, t in inputs.items() if torch.is_tensor(t)}
    local: dict = {}

    def norm(x):
        if x is None:
            return None
        if torch.is_tensor(x):
            sid = x.untyped_storage()._cdata
            label = by_storage.get(sid) or local.setdefault(sid, f"#{len(local)}")
            return ["T", label, list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype)]
        if isinstance(x, tuple):  # AuxData, descales: NamedTuples, compared as tuples
            return ["tuple", [norm(i) for i in x]]
        if isinstance(x, (bool, int, float)):
            return [type(x).__name__, x]
        return ["?", type(x).__name__, repr(x)]

    return [[kind, [norm(a) for a in args]] for kind, args in calls]


def dense(b, s, hq, hk, d, causal=True):
    """The engines' dense call: q, k, v (b, s, h, d), no LSE."""
    inp = {n: torch.empty(b, s, h, d, dtype=BF16, device="cuda")
           for n, h in (("q", hq), ("k", hk), ("v", hk))}
    return inp, dict(softmax_scale=d ** -0.5, causal=causal, return_lse=False)


def record(engine, cases, kinds, ours, setup, extra=lambda caches: {}):
    """The subprocess: argv is ROOT [case ...]; setup(copy) patches the copy further and
    returns its compile caches by kind; extra(caches) adds to each case's entry."""
    root, wanted = sys.argv[1], sys.argv[2:] or list(cases)
    src = sources.resolve(engine, root=root)
    I = sources.load(src)
    import cutlass.cute as cute

    log: list = []

    class Rec:
        def __init__(self, op):
            self.kind = kinds[type(op).__name__]

        def __call__(self, *a, **k):
            assert not k, k
            log.append((self.kind, a))

    cute.compile = lambda op, *a, **k: Rec(op)
    I.is_fake_mode = lambda: False
    caches = setup(I)
    fields = {"fwd": ABIS[engine].fwd_key, "combine": ABIS[engine].combine_key}
    result = {"source": src.record()}
    for name in wanted:
        for c in caches.values():
            c.clear()
        log.clear()
        with FakeTensorMode():
            inp, kw = cases[name]()
            I._flash_attn_fwd(**inp, **kw)
            got = norm_seq(log, inp)
            want = norm_seq(ours(inp, kw), inp)
        keys = {n: [{f: key_repr(x) for f, x in KeyFields(key, fields[n]).as_dict().items()}
                    | {"_len": len(key)} for key in c.cache]
                for n, c in caches.items() if n in fields}
        result[name] = {"copy": got, "fa4aot": want, "keys": keys, **extra(caches)}
    print("@@" + json.dumps(result))


def run(script: str, root: Path) -> dict:
    """Run tests/fa4/`script` over the copy at `root`; the JSON it prints."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fa4" / script), str(root)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout[r.stdout.index("@@") + 2:])


def assert_same_calls(got, want, tables):
    """The copy's call sequence `got` equals fa4aot's `want`, slot by slot; a kind `tables`
    has no slot names for (vLLM's batch > 256 helpers: upstream's) is compared by position."""
    assert [k for k, _ in got] == [k for k, _ in want]
    for (kind, a), (_, b) in zip(got, want):
        table = tables.get(kind)
        assert len(a) == len(b) == (len(table) if table else len(b)), kind
        for i, (x, y) in enumerate(zip(a, b)):
            slot = table[i] if table else i
            assert x == y, f"{kind} slot {i} ({slot}): copy {x}, fa4aot {y}"
