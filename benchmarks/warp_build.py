"""Build the kernels benchmarks/warp_probe.py times (CPU, no GPU): FA4's Ampere forward
(flash_attn.cute.flash_fwd.FlashAttentionForwardSm80: cp.async, mma.sync, warps along M) for
sm_90a, compiled from the arguments FA4 compiles fa4aot's split chunk kernel with and through
the same chunk modes (compiler.trace_chunk_modes(kernel=...)), so each takes the chunk kernel's
ABI. Its O store is forced to the non-TMA path (FA4 sets use_tma_O on sm90 for the sm90 kernel's
producer warp, which this kernel has not).

    python benchmarks/warp_build.py DIR 16x128x1x32,16x64x2x32,...   # tile_m x tile_n x stages x threads

writes DIR/warp_<config>.so (and .o) and prints each one's registers.
"""

from __future__ import annotations

import argparse
import pathlib
import time


def export_so(fn, stem: pathlib.Path, name: str = "fa4aot_fwd") -> list[int]:
    """A compiled kernel (`fn`, from cute.compile) exported as `stem`.o with an artifact's
    function name (`name`), its cubin checked for sm_90a, linked into `stem`.so as the
    builder links parts: -> its registers per thread."""
    from fa4aot import build, compiler, cubin

    obj = stem.with_suffix(".o")
    fn.export_to_c(object_file_path=str(obj), function_name=name)
    problem = cubin.target_problem(obj, "sm_90a")
    if problem:
        raise SystemExit(problem)
    build._link(obj, stem.with_suffix(".so"), compiler.runtime_library_dirs())
    return cubin.register_counts(obj)


def chunk_compiles(page_size: int | None = None) -> list:
    """FA4's compiles of fa4aot's sm90 bf16 hd128 split chunk kernel (compiler.trace of its
    representative call, for 132 SMs; page_size None: packed K), what the probe kernels here
    are compiled again from."""
    from fa4aot import compiler, variants

    compiler.configure("sm90", 132)
    v = variants.split_kernel_variant("sm90", "bfloat16", 128, 128, page_size)
    compiles: list = []
    compiler.trace(variants.representative_call(v, 132), compiles)
    return compiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("configs", help="tile_m x tile_n x stages x threads, comma-separated")
    a = ap.parse_args()
    from fa4aot import compiler

    compiles = chunk_compiles()
    from flash_attn.cute.flash_fwd import FlashAttentionForwardSm80

    out = pathlib.Path(a.outdir)
    out.mkdir(exist_ok=True)
    fa_fwd, _, _ = compiler._sm90_forward(compiles)

    class Warp(FlashAttentionForwardSm80):
        use_tma_O = property(lambda self: False, lambda self, v: None)

    for c in a.configs.split(","):
        tm, tn, st, th = (int(x) for x in c.split("x"))
        t = time.time()
        w = Warp(fa_fwd.dtype, fa_fwd.tile_hdim, fa_fwd.tile_hdimv, fa_fwd.qhead_per_kvhead,
                 is_causal=fa_fwd.is_causal, is_local=fa_fwd.is_local, pack_gqa=fa_fwd.pack_gqa,
                 tile_m=tm, tile_n=tn, num_stages=st, num_threads=th, Q_in_regs=False)
        regs = export_so(compiler.trace_chunk_modes(compiles, kernel=w), out / f"warp_{c}")
        print(f"warp_{c}: {time.time() - t:.1f} s, registers {regs}")


if __name__ == "__main__":
    main()
