"""Subprocess of test_vllm_build.py: vLLM's FA4 copy, sm90 cross-compile target. For each
Gemma-4 call, the copy's forward compile key (compile stubbed unless --compile) read back by
field name (vllm_copy.variant_from_key) against fa4aot's feature model (Call.variant), and the
variant's representative call against the same key; the split twins of the decode cases
(SPLITS: vllm_copy.split_twin, built from vllm_copy.split_needs's call) likewise; with --compile
OUTDIR, the named cases are compiled and exported (vllm_copy.compile_variant). Prints one JSON
object after "@@".

    python _vllm_build_check.py VLLM_ROOT [--compile OUTDIR case ...]
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.update(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", FLASH_ATTENTION_ARCH="sm_90",
                  CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
warnings.filterwarnings("ignore")

from fa4aot.fa4 import sources, vllm_copy  # noqa: E402
from fa4aot.fa4.driver import _cross_hardware_info  # noqa: E402
from fa4aot.model.compile_keys import Call, representative_call  # noqa: E402
from fa4aot.model.needs import Need  # noqa: E402

FP8 = "float8_e4m3fn"


def gemma(layout, b, sq, sk, hq=32, hk=4, d=512, page=None, kv=None, causal=True, wl=None,
          lse=False):
    return Call(layout=layout, batch=b, seqlen_q=sq, seqlen_k=sk, num_heads=hq,
                num_heads_kv=hk, head_dim=d, head_dim_v=d, dtype="bfloat16", causal=causal,
                window_left=wl, window_right=0 if wl is not None else None, return_lse=lse,
                sink_dtype=None, page_size=page, kv_dtype=kv)


CASES = {
    "bf16_p64_decode": gemma("paged", 4, 1, 4096, page=64),
    "bf16_p64_prefill": gemma("paged", 2, 256, 1024, page=64),
    "bf16_p64_decode_tp8": gemma("paged", 4, 1, 4096, hq=4, hk=1, page=64),
    "bf16_p16_decode": gemma("paged", 4, 1, 4096, page=16),
    "fp8_p64_decode": gemma("paged", 4, 1, 4096, page=64, kv=FP8),
    "fp8_p64_prefill": gemma("paged", 2, 256, 1024, page=64, kv=FP8),
    "fp8_p64_decode_tp8": gemma("paged", 4, 1, 4096, hq=4, hk=1, page=64, kv=FP8),
    "bf16_varlen_prefill": gemma("varlen", 2, 512, 512),
    "bf16_dense_prefill": gemma("dense", 2, 512, 512),
    "bf16_varlen_lse": gemma("varlen", 2, 64, 64, lse=True),
    # Gemma-4's sliding layers (hd256, 16 KV heads... as the spec has them) through the copy
    "swa_hd256_p64_decode": gemma("paged", 4, 1, 4096, hq=32, hk=16, d=256, page=64,
                                  causal=False, wl=1023),
}

# split twins: case -> the decode case it splits
SPLITS = {"bf16_p64_split": "bf16_p64_decode", "bf16_p16_split": "bf16_p16_decode",
          "fp8_p64_split": "fp8_p64_decode", "fp8_p64_split_tp8": "fp8_p64_decode_tp8"}


def variant_and_call(name):
    """(variant, its build call): a case's own, or a split twin's (vllm_copy.split_needs)."""
    if name in SPLITS:
        base = CASES[SPLITS[name]].variant("sm90", 132)
        (need,) = vllm_copy.split_needs([Need(base, representative_call(base, 132), "t", "t")])
        return need.variant, need.call
    want = CASES[name].variant("sm90", 132)
    return want, representative_call(want, 132)


def main():
    root = sys.argv[1]
    compile_dir = None
    names = [*CASES, *SPLITS]
    if len(sys.argv) > 2 and sys.argv[2] == "--compile":
        compile_dir, names = Path(sys.argv[3]), sys.argv[4:]
    I = sources.load(sources.resolve("vllm", root=root))
    _cross_hardware_info(132)
    import cutlass.cute as cute

    out = {}
    real = cute.compile
    for name in names:
        want, rep = variant_and_call(name)
        call = CASES.get(name, rep)
        row = {"variant": want.describe(), "id": want.id}
        if compile_dir is None:
            cute.compile = lambda *a, **k: (lambda *x, **y: None)
            try:
                got = vllm_copy.trace(I, call)
                back = vllm_copy.variant_from_key(got["fwd"][0][0], "sm90")
                row["key_variant"] = back.describe() if back else None
                row["match"] = back == want
                got2 = vllm_copy.trace(I, rep)
                row["representative_match"] = (
                    vllm_copy.variant_from_key(got2["fwd"][0][0], "sm90") == want)
                row["combines"] = len(got2["combine"])
            finally:
                cute.compile = real
        else:
            d = compile_dir / name
            d.mkdir(parents=True, exist_ok=True)
            rec = vllm_copy.compile_variant(I, rep, want, d)
            row["parts"] = {n: {k: v for k, v in p.items() if k != "object"}
                            | {"bytes": Path(p["object"]).stat().st_size}
                            for n, p in rec["parts"].items()}
            row["seconds"] = round(rec["compile_seconds"], 1)
        out[name] = row
    print("@@" + json.dumps(out))


if __name__ == "__main__":
    main()
