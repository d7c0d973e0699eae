#!/bin/bash
# Every H200 check and benchmark, in one device call, outputs under $1 (default /tmp/fa4aot-gpu).
# On the GPU host, from the project root, with a store built here and carried:
#   source .device/setup.sh && FA4AOT_CACHE_DIR=$PWD/.gpu-store bash benchmarks/gpu_session.sh $OUT [what...]
# what: any of tests split padding padding-tests dropin conformance host decode startup wheel
# padded-decode host-profile multidevice compile hbm hbm-streams triton-decode guard sanitize-guard warp tma smoke sweep sweep-small sweep-large sweep-page16 fold fold-long clock profile parity (default: tests split padding dropin conformance host decode
# startup). padding-tests: the padding GPU tests without the padding benchmarks (which need
# .gpu-store-bench). parity: from an empty store, needs the compiler bundle.
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
      fa4=""; python3 -c "import flash_attn.cute" 2>/dev/null || fa4="--no-fa4"
      { stamp python3 benchmarks/host_overhead.py $base $fa4; python3 benchmarks/host_overhead.py $base $fa4 --out "$out/host.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/host.txt"; cat "$out/host.txt";;
    padding-tests) { stamp python3 -m pytest -m gpu tests/test_gpu_padding.py; python3 -m pytest -m gpu tests/test_gpu_padding.py -q -p no:cacheprovider -rf 2>&1; } > "$out/gpu-padding-tests.txt"; tail -3 "$out/gpu-padding-tests.txt";;
    padding) { stamp python3 -m pytest -m gpu tests/test_gpu_padding.py; python3 -m pytest -m gpu tests/test_gpu_padding.py -q -p no:cacheprovider -rf 2>&1; } > "$out/gpu-padding-tests.txt"; tail -3 "$out/gpu-padding-tests.txt"
      { stamp python3 benchmarks/padding.py; python3 benchmarks/padding.py --exact-store .gpu-store-bench --pad-store .gpu-store --out "$out/padding.json" 2>&1; } > "$out/padding.txt"; cat "$out/padding.txt"
      { stamp python3 benchmarks/copy_probe.py; python3 benchmarks/copy_probe.py --pad-store .gpu-store --out "$out/copy-probe.json" 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; } > "$out/copy-probe.txt"; cat "$out/copy-probe.txt";;
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
    sweep-small) { stamp python3 benchmarks/split_sweep.py --small; python3 benchmarks/split_sweep.py --small --out "$out/sweep-small.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sweep-small.txt"; cat "$out/sweep-small.txt";;
    sweep-page16) { stamp python3 benchmarks/split_sweep.py --page 16; python3 benchmarks/split_sweep.py --page 16 --out "$out/sweep-page16.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sweep-page16.txt"; cat "$out/sweep-page16.txt";;
    sweep-large) { stamp python3 benchmarks/split_sweep.py --large; python3 benchmarks/split_sweep.py --large --out "$out/sweep-large.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sweep-large.txt"; cat "$out/sweep-large.txt";;
    fold) { stamp python3 benchmarks/fold_kernels.py; python3 benchmarks/fold_kernels.py --out "$out/fold.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/fold.txt"; cat "$out/fold.txt";;
    clock) { stamp python3 benchmarks/clock_probe.py; python3 benchmarks/clock_probe.py --out "$out/clock.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/clock.txt"; cat "$out/clock.txt";;
    fold-long) { stamp python3 benchmarks/fold_kernels.py --long; python3 benchmarks/fold_kernels.py --long --out "$out/fold-long.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/fold-long.txt"; cat "$out/fold-long.txt";;
    profile) { stamp python3 benchmarks/split_profile.py; python3 benchmarks/split_profile.py --out "$out/split-profile.json" 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; } > "$out/split-profile.txt"; cat "$out/split-profile.txt";;
    hbm) { stamp python3 benchmarks/hbm_ceiling.py; python3 benchmarks/hbm_ceiling.py --out "$out/hbm.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/hbm.txt"; cat "$out/hbm.txt";;
    hbm-streams) { stamp python3 benchmarks/hbm_ceiling.py --streams --cells 16:65536,16:131072,4:65536,32:131072,16:16384; python3 benchmarks/hbm_ceiling.py --streams --cells 16:65536,16:131072,4:65536,32:131072,16:16384 --out "$out/hbm-streams.json" 2>&1 | grep -v -e Warning -e exe_args -e warn_once; } > "$out/hbm-streams.txt"; cat "$out/hbm-streams.txt";;
    triton-decode) { stamp python3 benchmarks/triton_decode_probe.py; python3 benchmarks/triton_decode_probe.py --out "$out/triton-decode.json" 2>&1 | grep -v -e Warning -e exe_args -e warn_once; } > "$out/triton-decode.txt"; cat "$out/triton-decode.txt";;
    guard) { stamp python3 benchmarks/guard_probe.py; python3 benchmarks/guard_probe.py --out "$out/guard.json" 2>&1 | grep -v -e Warning -e exe_args -e warn_once; } > "$out/guard.txt"; cat "$out/guard.txt";;
    sanitize-guard) { stamp PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/test_gpu_split.py -k empty_first_sequence; PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/test_gpu_split.py -k empty_first_sequence -q -p no:cacheprovider -rf 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sanitize-guard.txt"; tail -6 "$out/sanitize-guard.txt";;
    warp) { stamp python3 benchmarks/warp_probe.py --kernels .gpu-warp; python3 benchmarks/warp_probe.py --kernels .gpu-warp --out "$out/warp.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/warp.txt"; cat "$out/warp.txt";;
    tma) { stamp python3 benchmarks/tma_page_probe.py; python3 benchmarks/tma_page_probe.py --out "$out/tma.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/tma.txt"; cat "$out/tma.txt";;
    smoke) # every script that parses --cells (benchmarks/_timing.parse_cells), on one small cell
      { for sc in balanced_probe hbm_ceiling kernel_probe tma_page_probe clock_probe fold_kernels "warp_probe --kernels .gpu-warp"; do
          read -r name args <<< "$sc"
          stamp python3 benchmarks/$name.py $args --cells 4:4096; python3 benchmarks/$name.py $args --cells 4:4096 2>&1 | grep -v -e Warning -e exe_args | tail -6; echo "exit ${PIPESTATUS[0]}"
        done; } > "$out/smoke.txt"; grep -e "^exit" -e command "$out/smoke.txt";;
    sweep) { stamp python3 benchmarks/split_sweep.py; python3 benchmarks/split_sweep.py --out "$out/sweep.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/sweep.txt"; cat "$out/sweep.txt";;
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
    host-profile) { for s in 1:131072:8:1 1:8192:32:8; do stamp python3 benchmarks/host_profile.py --shape $s; python3 benchmarks/host_profile.py --shape $s 2>&1 | grep -v -e Warning -e exe_args -e _warn_once; done; } > "$out/host-profile.txt"; grep "host us" "$out/host-profile.txt";;
    startup) { stamp python3 benchmarks/startup.py; python3 benchmarks/startup.py --out "$out/startup.json" 2>&1 | grep -v -e Warning -e exe_args; } > "$out/startup.txt"; tail -25 "$out/startup.txt";;
  esac
done
