"""What the store's integrity and safety checks cost per artifact load (CPU, page cache warm).

    python benchmarks/store_integrity.py [--real-store .gpu-store] [--out FILE.json]

- sha256 verify of one part (Artifact.verify) for 35 KB / 100 KB / 1 MB parts;
- Store.get(verify=True): record read + JSON parse + record digest + toolchain check + verify;
- Artifact.unsafe_reason: one stat per directory from the part up to /;
- lock hold + release, flock and marker;
- with --real-store: sha256 of every real artifact part of a store (what the runtime checks).
Medians over many runs; the runtime does this once per artifact per process, never per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4aot.store import locking  # noqa: E402
from fa4aot.store.files import sha256_file  # noqa: E402
from fa4aot.store.layers import Store  # noqa: E402
from fa4aot.store.records import RECORD, RECORD_FORMAT, Artifact, seal_record  # noqa: E402
from fa4aot.store.toolchain import build_toolchain  # noqa: E402


def median_us(fn, n: int) -> dict:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {
        "median_us": round(statistics.median(ts) * 1e6, 1),
        "p99_us": round(ts[int(0.99 * (len(ts) - 1))] * 1e6, 1),
        "runs": n,
    }


def synthetic(root: Path, size: int) -> Store:
    store = Store(root, build_toolchain("sm90", 132))
    store.ensure()
    d = store.artifact_dir(f"bench{size}")
    d.mkdir(parents=True)
    (d / "fwd.so").write_bytes(os.urandom(size))
    rec = seal_record(
        {
            "format": RECORD_FORMAT,
            "id": d.name,
            "variant": {},
            "stub": False,
            "toolchain": store.toolchain,
            "sm_count_independent": False,
            "parts": {"fwd": {"file": "fwd.so", "size": size, "sha256": sha256_file(d / "fwd.so")}},
        }
    )
    (d / RECORD).write_text(json.dumps(rec, indent=2, sort_keys=True))
    return store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real-store", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", type=int, default=2000)
    a = ap.parse_args()
    res: dict = {"python": sys.version.split()[0], "cpu": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (35_000, 100 * 1024, 1 << 20):
            store = synthetic(Path(tmp) / str(size), size)
            vid = f"bench{size}"
            art = store.get(vid, verify=False)
            res[f"verify_{size}B"] = median_us(art.verify, a.n)
            res[f"get_verify_{size}B"] = median_us(
                lambda s=store, v=vid: s.get(v, verify=True), a.n
            )
        res["unsafe_reason"] = median_us(art.unsafe_reason, a.n)
        for mode in ("flock", "marker"):
            lock = Path(tmp) / f"{mode}.lock"

            def hold(lock=lock, mode=mode):
                with locking.hold(lock, timeout=5, mode=mode):
                    pass

            res[f"lock_{mode}"] = median_us(hold, min(a.n, 500))
    if a.real_store:
        parts = sorted(a.real_store.rglob("*.so"))
        sizes = sorted(p.stat().st_size for p in parts)
        per = []
        for p in parts:
            art = Artifact(
                p.parent,
                {
                    "parts": {
                        "fwd": {"file": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)}
                    }
                },
            )
            per.append(median_us(art.verify, 20)["median_us"])
        res["real_parts"] = {
            "count": len(parts),
            "size_min": sizes[0],
            "size_median": sizes[len(sizes) // 2],
            "size_max": sizes[-1],
            "verify_median_us": statistics.median(per),
            "verify_max_us": max(per),
        }
    for k, v in res.items():
        print(f"{k:24s} {v}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
