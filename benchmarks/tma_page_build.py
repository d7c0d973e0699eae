"""Build the kernel benchmarks/tma_page_probe.py --kernel times (CPU, no GPU): the paged split
chunk kernel for pages of P keys (P < FA4's 128-key tile, which FA4 serves on its cp.async path)
compiled again with P-key tiles on FA4's TMA paged path (compiler.trace_tma_page, what the
artifact's part `fwd_tma` holds for P = 64), with the chunk kernel's ABI.

    python benchmarks/tma_page_build.py DIR [--page 64]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--page", type=int, default=64)
    a = ap.parse_args()
    from fa4aot import compiler

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from warp_build import chunk_compiles, export_so

    compiles = chunk_compiles(a.page)
    out = pathlib.Path(a.outdir)
    out.mkdir(exist_ok=True)
    regs = export_so(compiler.trace_tma_page(compiles, a.page), out / f"tma_p{a.page}")
    print(f"tma_p{a.page}: registers {regs}")


if __name__ == "__main__":
    main()
