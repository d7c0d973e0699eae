"""Build the kernels benchmarks/pdl_probe.py times (CPU, no GPU): the split step's two kernels
with and without programmatic dependent launch (PDL).

- merge_plain.so, merge_pdl.so: fa4aot's merge (compiler.trace_merge) for the bf16 hd128 split
  chunk kernel, launched as the store's (a plain launch) and as a PDL secondary (the launch's
  programmatic stream serialization; the kernel waits on griddepcontrol.wait before it reads
  the partials), function `fa4aot_merge`;
- chunk_trig.so, wide_trig.so: the chunk kernel (the artifact's part `fwd`) and the wide split
  kernel (part `fwd_wide_split`) compiled with griddepcontrol.launch_dependents at each CTA's
  start (compiler.trace_chunk_modes(trigger=True)), so a PDL merge may launch as soon as every
  chunk CTA has started rather than when the last has exited; function `fa4aot_fwd`.

    python benchmarks/pdl_build.py DIR
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
        regs = export_so(fn, out / name, "fa4aot_merge")
        print(f"{name}: registers {regs}")
    fn = compiler.trace_chunk_modes(compiles, trigger=True)
    print(f"chunk_trig: registers {export_so(fn, out / 'chunk_trig')}")
    fn = compiler.trace_wide_fold(compiles, C.WIDE_SPLIT, paged=False, trigger=True)
    print(f"wide_trig: registers {export_so(fn, out / 'wide_trig')}")


if __name__ == "__main__":
    main()
