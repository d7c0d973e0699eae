"""A decode step for Nsight Compute: fa4aot as planned, then torch SDPA's cuDNN backend, on the
same dense inputs (bf16 hd128 32:8, one query row), twice each. Run it under ncu, e.g. (H200):

    ncu --clock-control none --metrics dram__bytes_read.sum,gpu__time_duration.sum \\
        python benchmarks/ncu_decode.py --cell 16:65536

so the two kernels' DRAM traffic and rates can be compared (kernel_probe.py gives their grids;
torch.profiler and ncu cannot share a process).
"""

from __future__ import annotations

import argparse
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="16:65536", help="batch:keys")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs

    b, sk = (int(x) for x in a.cell.split(":"))
    cols = decode_columns(*decode_inputs(b, sk))
    print(f"b{b} sk{sk}: K+V {b * sk * 8 * 128 * 2 * 2 / 1e9:.3f} GB")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for _ in range(2):
            cols["fa4aot"]()
            cols["cudnn"]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
