"""CPU checks of the benchmarks (no GPU): every script starts and imports only helpers that
exist, gpu_session.sh runs only scripts that exist, and the helpers that read recorded results
count right."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "_timing.py")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_tally_counts_each_cell_over_runs(tmp_path):
    """decode_split.py --tally: per grid cell, the runs at or below cuDNN (a tie counts), eager
    and in a graph, and the eager ratios' median and range; per run, the summary's counts and
    cuDNN's read rate at b16/64K."""
    ds = _module("decode_split")

    def cell(b, sk, ours, cudnn, ours_g, cudnn_g):
        return {"b": b, "sk": sk, "fa4aot": ours, "cudnn": cudnn, "fa4aot_graph": ours_g,
                "cudnn_graph": cudnn_g}

    runs = [
        [dict(cell(16, 65536, 101.0, 100.0, 99.0, 100.0), kv_mb=460.0),
         cell(1, 1024, 9.0, 10.0, 5.0, 5.0)],
        [cell(16, 65536, 99.0, 100.0, 101.0, 100.0), cell(1, 1024, 12.0, 10.0, 6.0, 5.0),
         {"b": 128, "sk": 131072, "skipped": "memory"}],
        [cell(16, 65536, 102.0, 100.0, 102.0, 100.0), cell(1, 1024, 10.0, 10.0, 4.0, 5.0)],
    ]
    paths = []
    for i, grid in enumerate(runs):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps({"grid": grid}))
        paths.append(str(p))
    t = ds.tally(paths)
    assert [(e, g) for _, e, g, _ in t["runs"]] == [(1, 2), (1, 0), (1, 1)]
    # the machine: cuDNN's read rate at b16/64K (MB per us = TB/s), where the run recorded it
    assert [tbs for *_, tbs in t["runs"]] == [4.6, None, None]
    big = t["cells"]["b16/64K"]
    assert (big["runs"], big["eager_at_or_below"], big["graph_at_or_below"]) == (3, 1, 1)
    assert (big["eager_median"], big["eager_min"], big["eager_max"]) == (1.01, 0.99, 1.02)
    small = t["cells"]["b1/1K"]
    assert (small["eager_at_or_below"], small["graph_at_or_below"]) == (2, 2)
    assert "b128/128K" not in t["cells"]  # a skipped cell is not a run of it


def test_every_script_answers_help_on_the_cpu():
    """Each benchmark parses its arguments before it needs a GPU or a store, so `--help` runs
    here: a script whose module-level imports broke fails."""
    assert len(SCRIPTS) >= 8
    code = (
        "import runpy, sys\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (path, e.code)\n"
        "    else:\n"
        "        raise AssertionError(path + ' did not stop at --help')\n"
        "    print('ok', path)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *map(str, SCRIPTS)], cwd=BENCH,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok ") == len(SCRIPTS)


# imported by some benchmark but absent from a CPU test environment: a baseline tree made for a
# side-by-side run (host_overhead.py --baseline), the plot's library, and GPU-host extras
_OPTIONAL = {"fa4aot_base", "matplotlib", "flash_attn", "triton", "numpy", "tvm_ffi",
             "torch_c_dlpack_ext"}


def test_scripts_import_only_modules_that_exist():
    """Every module a benchmark imports (inside functions too, which --help does not reach)
    resolves here, benchmarks/ on the path, or is a known optional one; `from _timing import`
    names functions _timing defines. A script left importing a deleted probe fails."""
    timing = {n.name for n in ast.parse((BENCH / "_timing.py").read_text()).body
              if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    sys.path.insert(0, str(BENCH))
    try:
        from_timing = 0
        for path in [*SCRIPTS, BENCH / "_timing.py"]:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "_timing":
                    missing = {a.name for a in node.names} - timing
                    assert not missing, f"{path.name}: _timing has no {sorted(missing)}"
                    from_timing += 1
                if isinstance(node, ast.Import):
                    tops = {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    tops = {node.module.split(".")[0]}
                else:
                    continue
                for top in tops - _OPTIONAL:
                    assert importlib.util.find_spec(top), f"{path.name} imports {top}: not found"
    finally:
        sys.path.remove(str(BENCH))
    assert from_timing >= 6


def test_gpu_session_runs_only_scripts_that_exist():
    text = (BENCH / "gpu_session.sh").read_text()
    named = set(re.findall(r"benchmarks/([\w.]+\.py)", text))
    assert {"decode_split.py", "host_overhead.py", "startup.py", "padding.py"} <= named
    assert not [n for n in named if not (BENCH / n).exists()]
    # the usage line lists every target the case statement has
    targets = set(re.findall(r"^    ([a-z][\w-]*)\)", text, re.MULTILINE))
    usage = text.split("# what: any of", 1)[1].split("(default:", 1)[0]
    assert targets == set(usage.replace("#", " ").split()), (targets, usage)
