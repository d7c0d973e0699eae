#!/bin/bash
# Every H200 check and benchmark, in one device call, outputs under $1 (default /tmp/fa4aot-gpu).
# On the GPU host, from the project root, with a store built here and carried:
#   source .device/setup.sh && FA4AOT_CACHE_DIR=$PWD/.gpu-store bash benchmarks/gpu_session.sh $OUT [what...]
# what: any of tests split padding padding-tests dropin conformance host decode startup wheel
# padded-decode spec-decode ragged host-profile multidevice compile sanitize-guard parity (default:
# tests split padding dropin conformance host decode startup). padding-tests: the padding GPU
# tests without the padding benchmark (which needs .gpu-store-bench). parity: from an empty
# store, needs the compiler bundle.
# host: with .gpu-base/fa4aot_base present (an earlier fa4aot), timed side by side.
# wheel: packs $FA4AOT_CACHE_DIR into a cache wheel (fa4aot wheel), pip-installs it into a fresh
# --target dir, then `fa4aot doctor` and the conformance check served from the wheel alone (the
# only other layer is empty).
set -u
out=${1:-/tmp/fa4aot-gpu}; shift || true
what=${*:-tests split padding dropin conformance host decode startup}
mkdir -p "$out"
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"; echo "# command: $*"; }
for w in $what; do
  case $w in
    tests) { stamp python3 -m pytest -m gpu tests/test_gpu_runtime.py; python3 -m pytest -m gpu tests/test_gpu_runtime.py -q -p no:cacheprovider -rf 2>&1; } > "$out/gpu-tests.txt"; tail -3 "$out/gpu-tests.txt";;
    split) { stamp python3 -m pytest -m gpu tests/test_gpu_split.py; python3 -m pytest -m gpu tests/test_gpu_split.py -q -s -p no:cacheprovider -rf 2>&1 | grep -v -e Warning -e exe_args; } > "$out/gpu-split-tests.txt"; tail -4 "$out/gpu-split-tests.txt";;
    decode) { stamp python3 benchmarks/decode_split.py; python3 benchmarks/decode_split.py --out "$out/decode.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/decode.txt"; cat "$out/decode.txt";;
    conformance) { stamp python3 .device/checks/gpu_conformance.py; python3 .device/checks/gpu_conformance.py 2>&1; } > "$out/conformance.txt"; tail -1 "$out/conformance.txt";;
    host) base=""; [ -d .gpu-base/fa4aot_base ] && base="--baseline .gpu-base"
      # (the baseline serves from a store it built itself: store formats change; needs the compiler)
      [ -n "$base" ] && PYTHONPATH=.gpu-base:$PYTHONPATH python3 -m fa4aot_base.cli build --cache /tmp/fa4aot-base-store --spec llama-3.1-8b -j 16 2>&1 | tail -1 && base="$base --baseline-cache /tmp/fa4aot-base-store"
      fa4=""; python3 -c "import flash_attn.cute" 2>/dev/null || fa4="--no-fa4"
      { stamp python3 benchmarks/host_overhead.py $base $fa4; python3 benchmarks/host_overhead.py $base $fa4 --out "$out/host.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/host.txt"; cat "$out/host.txt";;
    padding-tests) { stamp python3 -m pytest -m gpu tests/test_gpu_padding.py; python3 -m pytest -m gpu tests/test_gpu_padding.py -q -p no:cacheprovider -rf 2>&1; } > "$out/gpu-padding-tests.txt"; tail -3 "$out/gpu-padding-tests.txt";;
    padding) { stamp python3 -m pytest -m gpu tests/test_gpu_padding.py; python3 -m pytest -m gpu tests/test_gpu_padding.py -q -p no:cacheprovider -rf 2>&1; } > "$out/gpu-padding-tests.txt"; tail -3 "$out/gpu-padding-tests.txt"
      { stamp python3 benchmarks/padding.py; python3 benchmarks/padding.py --exact-store .gpu-store-bench --pad-store .gpu-store --out "$out/padding.json" 2>&1; } > "$out/padding.txt"; cat "$out/padding.txt";;
    dropin) { stamp python3 -m pytest -m gpu tests/test_gpu_dropin.py; python3 -m pytest -m gpu tests/test_gpu_dropin.py -q -s -p no:cacheprovider -rf 2>&1 | grep -v -e Warning -e exe_args; } > "$out/gpu-dropin-tests.txt"; tail -3 "$out/gpu-dropin-tests.txt";;
    wheel) { stamp python3 -m fa4aot.cli wheel /tmp/dist --cache "$FA4AOT_CACHE_DIR"; python3 -m fa4aot.cli wheel /tmp/dist --cache "$FA4AOT_CACHE_DIR" 2>&1
        echo "# command: pip install --no-index --no-deps --target /tmp/wheelsite /tmp/dist/*.whl"
        python3 -m pip install -q --no-index --no-deps --target /tmp/wheelsite /tmp/dist/*.whl 2>&1
        mkdir -p /tmp/empty-layer
        echo "# command: FA4AOT_CACHE_DIR=/tmp/empty-layer PYTHONPATH=/tmp/wheelsite:\$PYTHONPATH python3 -m fa4aot.cli doctor"
        FA4AOT_CACHE_DIR=/tmp/empty-layer PYTHONPATH=/tmp/wheelsite:$PYTHONPATH python3 -m fa4aot.cli doctor 2>&1
        echo "# command: FA4AOT_CACHE_DIR=/tmp/empty-layer PYTHONPATH=/tmp/wheelsite:\$PYTHONPATH python3 .device/checks/gpu_conformance.py"
        FA4AOT_CACHE_DIR=/tmp/empty-layer PYTHONPATH=/tmp/wheelsite:$PYTHONPATH python3 .device/checks/gpu_conformance.py 2>&1; } > "$out/wheel.txt"; grep -e "would serve" -e problem -e passed "$out/wheel.txt";;
    multidevice) { stamp python3 -m pytest -m gpu tests/test_gpu_multidevice.py; nvidia-smi -L; python3 -m pytest -m gpu tests/test_gpu_multidevice.py -v -p no:cacheprovider -rf 2>&1 | grep -v -e Warning -e exe_args; } > "$out/multidevice.txt"; tail -3 "$out/multidevice.txt";;
    compile) { stamp python3 -m pytest -m gpu tests/test_gpu_compile.py; python3 -m pytest -m gpu tests/test_gpu_compile.py -v -p no:cacheprovider -p no:logging -rf --tb=short 2>&1 | grep -v -e Warning -e exe_args -e warnings.warn; } > "$out/compile.txt"; tail -3 "$out/compile.txt";;
    sanitize-guard) { stamp PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/test_gpu_split.py -k empty_first_sequence; PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/test_gpu_split.py -k empty_first_sequence -q -p no:cacheprovider -rf 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sanitize-guard.txt"; tail -6 "$out/sanitize-guard.txt";;
    parity) # issue 13's loop, from an empty store: the tests' own miss log, one build, all served
      # (needs the compiler bundle: install() and the build)
      ps=$(mktemp -d); log=$ps.misses.jsonl
      { stamp "FA4AOT_CACHE_DIR=<empty> FA4AOT_MISS_LOG=m.jsonl pytest -m gpu tests/test_gpu_parity.py  (round 1: misses)"
        FA4AOT_CACHE_DIR=$ps FA4AOT_MISS_LOG=$log python3 -m pytest -m gpu tests/test_gpu_parity.py -q -p no:cacheprovider 2>&1 | tail -1
        echo "misses logged: $(wc -l < $log)"
        stamp "fa4aot build --cache <that store> --from-misses m.jsonl -j 16"
        python3 -m fa4aot.cli build --cache $ps --from-misses $log -j 16 2>&1 | tail -2
        stamp "FA4AOT_CACHE_DIR=<that store> pytest -m gpu tests/test_gpu_parity.py  (round 2)"
        FA4AOT_CACHE_DIR=$ps python3 -m pytest -m gpu tests/test_gpu_parity.py -v -p no:cacheprovider -rf --tb=line 2>&1 | grep -v -e Warning -e exe_args; } > "$out/parity.txt"; grep -e passed -e failed -e "misses logged" -e "^built" "$out/parity.txt";;
    padded-decode) { stamp python3 benchmarks/padded_decode.py; python3 benchmarks/padded_decode.py --out "$out/padded.json" 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; } > "$out/padded.txt"; cat "$out/padded.txt";;
    spec-decode) { stamp python3 benchmarks/spec_decode.py; python3 benchmarks/spec_decode.py --out "$out/spec.json" 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; } > "$out/spec.txt"; cat "$out/spec.txt";;
    ragged) { stamp python3 benchmarks/decode_ragged.py; python3 benchmarks/decode_ragged.py --json "$out/ragged.json" 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; } > "$out/ragged.txt"; cat "$out/ragged.txt";;
    host-profile) { for s in 1:131072:8:1 1:8192:32:8; do stamp python3 benchmarks/host_profile.py --shape $s; python3 benchmarks/host_profile.py --shape $s 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; done; } > "$out/host-profile.txt"; grep "host us" "$out/host-profile.txt";;
    startup) { stamp python3 benchmarks/startup.py; python3 benchmarks/startup.py --out "$out/startup.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/startup.txt"; tail -25 "$out/startup.txt";;
  esac
done
