"""Build the kernel benchmarks/warp_probe.py times as `warp_64x64x2x256` (CPU, no GPU): the
packed split chunk kernel's wide fold kernel (64-key tiles, two CTAs per SM;
compiler.trace_wide_fold) compiled through the split's chunk modes (compiler.trace_chunk_modes),
so a split step's chunks can run on it: constraints.WIDE_SPLIT, what the artifact's part
`fwd_wide_split` holds since `acce2a3` (this script measured it first: 2026-12-02-s16-f/g). The
artifact's `fwd_wide` has FA4's ABI without the chunk modes and serves only the fold.

    python benchmarks/wide_chunk_build.py DIR      # -> DIR/warp_64x64x2x256.so
    python benchmarks/wide_chunk_build.py DIR --page P   # -> DIR/wide_split_paged_P.so

--page: the same kernel for a paged K (pages of P, the chunk-length mode, FA4's cp.async
paged path, as the paged `fwd_wide` is built), which fa4aot does not ship:
`wide_split_probe.py --paged-kernel` times it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--page", type=int)
    a = ap.parse_args()
    from fa4aot import compiler
    from fa4aot import constraints as C

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from warp_build import chunk_compiles, export_so

    compiles = chunk_compiles(a.page)
    out = pathlib.Path(a.outdir)
    out.mkdir(exist_ok=True)
    if a.page:
        wide = C.WIDE_SPLIT._replace(paged=True)
        fn = compiler.trace_wide_fold(compiles, wide, paged=True, pdl=True)
        regs = export_so(fn, out / f"wide_split_paged_{a.page}")
        print(f"wide_split_paged_{a.page} (paged fwd_wide through the chunk modes): "
              f"registers {regs}")
        return
    fn = compiler.trace_wide_fold(compiles, C.WIDE_SPLIT, paged=False)
    regs = export_so(fn, out / "warp_64x64x2x256")
    print(f"warp_64x64x2x256 (fwd_wide through the chunk modes): registers {regs}")


if __name__ == "__main__":
    main()
