"""Build the kernels benchmarks/pdl_probe.py times against the store's (CPU, no GPU): the split
step's kernels with and without programmatic dependent launch (PDL), for the bf16 hd128 split
chunk kernel (packed K).

- merge_plain.so, merge_pdl.so: fa4aot's merge (compiler.trace_merge) launched plainly (as
  before C.MERGE_VERSION 2) and as a PDL secondary (as shipped), function `fa4aot_merge`;
- chunk_plain.so, wide_plain.so, fold_plain.so, fold1_plain.so: the chunk kernel (the
  artifact's part `fwd`), the wide split kernel (part `fwd_wide_split`) and the fold's wide
  kernels (parts `fwd_wide`, `fwd_wide1`) launched plainly, as before compiler._pdl_secondary
  (the store now ships each as a PDL secondary), function `fa4aot_fwd`.

    python benchmarks/pdl_build.py DIR

(The first probes, 2026-12-02-s17-a/b, also timed chunk kernels that ran
griddepcontrol.launch_dependents at each CTA's first tile, built by this script at 9a5d6d5.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    a = ap.parse_args()
    from fa4aot import compiler, variants
    from fa4aot import constraints as C

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from warp_build import chunk_compiles, export_so

    out = pathlib.Path(a.outdir)
    out.mkdir(exist_ok=True)
    compiles = chunk_compiles()
    v = variants.split_kernel_variant("sm90", "bfloat16", 128, 128, None)
    for name, pdl in (("merge_plain", False), ("merge_pdl", True)):
        [(_, fn)] = compiler.trace_merge(v, pdl=pdl)
        print(f"{name}: registers {export_so(fn, out / name, 'fa4aot_merge')}")
    fn = compiler.trace_chunk_modes(compiles)
    print(f"chunk_plain: registers {export_so(fn, out / 'chunk_plain')}")
    for name, wide in (("wide_plain", C.WIDE_SPLIT), ("fold_plain", C.WIDE_FOLD),
                       ("fold1_plain", C.WIDE_FOLD_1)):
        fn = compiler.trace_wide_fold(compiles, wide, paged=False)
        print(f"{name}: registers {export_so(fn, out / name)}")


if __name__ == "__main__":
    main()
