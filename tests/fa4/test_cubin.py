"""Every sm100/sm103 artifact carries a cubin for its own SM target, checked on the CPU.

A real cross-compile of the tiny spec (1 kernel) per Blackwell arch into a store, then the ELF
header of the cubin embedded in each published shared object (fa4aot/fa4/cubin.py), and cuobjdump's
reading of it when one is installed. About 30 s on 2 cores: the compiler import dominates."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import fa4aot.build.builder as B
from fa4aot.model import constraints as C
from fa4aot import settings
from fa4aot.fa4 import cubin
from fa4aot.model.specs import parse_spec

# one kernel per arch (no LSE twin): one worker's compiler import, the bulk of the cost
TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text().replace(
    'return_lse = "both"', "return_lse = false"
)
# B300's SKU SM count is not settled (constraints.DEFAULT_NUM_SMS): any count builds
SMS = {"sm100": 148, "sm103": 148}


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # noqa: PLC0415 (its wheel carries a cuobjdump)
    except Exception:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.is_file() and os.access(p, os.X_OK) else None


@pytest.fixture(scope="module", params=["sm100", "sm103"])
def built(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"store-{arch}")
    spec = parse_spec(TINY, "tiny.toml")
    # jobs=2: a spawned worker per build, configured for its arch before its first FA4 import
    # (this process can target one arch only, and another module may have imported FA4)
    with settings.scope(stub_compiler=None):
        store, plan, results = B.build([spec], arch=arch, root=root, jobs=2, num_sms=SMS[arch])
    assert [r.status for r in results] == ["built"], [r.error for r in results]
    return arch, store


def _parts(store):
    out = []
    for _, art in store.iter_artifacts():
        assert not isinstance(art, Exception), art
        out += [art.part_path(n) for n in art.record["parts"]]
    return out


@pytest.mark.slow
def test_every_part_carries_its_arch_cubin(built):
    arch, store = built
    parts = _parts(store)
    assert len(parts) == 1
    for p in parts:
        assert cubin.target_problem(p, C.cubin_target(arch)) is None
        (c,) = cubin.cubin_targets(p)
        assert c.sm == C.ARCHS[arch] and c.arch_specific


@pytest.mark.slow
def test_cuobjdump_agrees(built, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump installed")
    arch, store = built
    p = _parts(store)[0]
    data = p.read_bytes()
    (c,) = cubin.embedded_cubins(data)
    raw = tmp_path / "k.cubin"
    raw.write_bytes(data[c.offset : c.offset + c.size])
    sass = subprocess.run([tool, "-sass", str(raw)], capture_output=True, text=True, timeout=60)
    assert f"code for {C.cubin_target(arch)}" in sass.stdout, sass.stdout[:400] + sass.stderr


def test_a_mistargeted_object_is_named(tmp_path):
    """The check's own logic on a synthetic object: an sm_100a cubin where sm_103a is expected,
    no cubin at all, and the older ABI's flag layout."""

    def elf(machine: int, flags: int, abi: int) -> bytes:
        h = bytearray(64)
        h[0:4], h[4], h[5], h[6], h[8] = b"\x7fELF", 2, 1, 1, abi
        h[18:20] = machine.to_bytes(2, "little")
        h[48:52] = flags.to_bytes(4, "little")
        return bytes(h)

    host = elf(62, 0, 0)  # x86-64: the host object around the cubin
    obj = tmp_path / "k.o"
    obj.write_bytes(host + b"\0" * 32 + elf(cubin.EM_CUDA, 0x6006402, 8) + b"\0" * 64)
    assert [c.target for c in cubin.cubin_targets(obj)] == ["sm_100a"]
    assert "sm_100a, expected sm_103a" in cubin.target_problem(obj, "sm_103a")
    assert cubin.target_problem(obj, "sm_100a") is None
    obj.write_bytes(host)
    assert "no embedded cubin" in cubin.target_problem(obj, "sm_100a")
    obj.write_bytes(host + elf(cubin.EM_CUDA, 0x85A, 7))  # ABI 7: sm in bits 0-7, "a" bit 11
    assert [c.target for c in cubin.cubin_targets(obj)] == ["sm_90a"]
    assert [c.target for c in cubin.embedded_cubins(elf(cubin.EM_CUDA, 0x6006700, 8))] == ["sm_103"]


def test_sm103_is_its_own_target_and_needs_an_sm_count():
    assert C.cubin_target("sm100") == "sm_100a" and C.cubin_target("sm103") == "sm_103a"
    assert C.is_blackwell("sm103") and C.is_blackwell("sm100") and not C.is_blackwell("sm90")
    with pytest.raises(ValueError, match="--num-sms"):
        C.default_num_sms("sm103")
    assert C.default_num_sms("sm100") == 148
    from fa4aot.store.toolchain import build_toolchain, fingerprint_dir

    a, b = build_toolchain("sm100", 148), build_toolchain("sm103", 148)
    assert fingerprint_dir(a) != fingerprint_dir(b)


def test_build_sm103_without_num_sms_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from fa4aot.cli import main

    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    r = CliRunner().invoke(
        main, ["build", "--arch", "sm103", "--spec", str(spec), "--dry-run", "--cache",
               str(tmp_path / "c")]
    )
    assert r.exit_code == 2 and "--num-sms" in r.output, r.output
    r = CliRunner().invoke(
        main, ["build", "--arch", "sm103", "--num-sms", "148", "--spec", str(spec), "--dry-run",
               "--cache", str(tmp_path / "c"), "--json"]
    )
    assert r.exit_code == 0, r.output


def test_gpu_names_the_arch_and_sm_count_and_refuses_a_contradiction(tmp_path):
    """`--gpu` sets (arch, num_sms) from constraints.GPUS; the sm103 error names the SKUs' counts;
    an --arch or --num-sms given beside --gpu must agree with it (exit 2)."""
    import json

    from click.testing import CliRunner

    from fa4aot.cli import main

    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    base = ["build", "--spec", str(spec), "--dry-run", "--cache", str(tmp_path / "c")]
    assert C.GPUS["b300"] == ("sm103", 148) and C.GPUS["gb300"] == ("sm103", 152)
    assert C.GPUS["gb200"] == ("sm100", 152) and C.GPUS["h200"] == ("sm90", 132)
    with pytest.raises(ValueError, match="B300 148, GB300 152.*--gpu b300 or --gpu gb300"):
        C.default_num_sms("sm103")
    for gpu, (arch, sms) in C.GPUS.items():
        r = CliRunner().invoke(main, [*base, "--gpu", gpu, "--json"])
        assert r.exit_code == 0, r.output
        rows = json.loads(r.output)["rows"]
        assert rows and {(w["arch"], w["num_sms"]) for w in rows} == {(arch, sms)}, gpu
    r = CliRunner().invoke(main, [*base, "--gpu", "gb300", "--arch", "sm103"])
    assert r.exit_code == 0, r.output  # agrees
    r = CliRunner().invoke(main, [*base, "--gpu", "gb300", "--arch", "sm100"])
    assert r.exit_code == 2 and "--gpu gb300 is sm103" in r.output, r.output
    r = CliRunner().invoke(main, [*base, "--gpu", "gb300", "--num-sms", "148"])
    assert r.exit_code == 2 and "has 152 SMs" in r.output, r.output
    r = CliRunner().invoke(main, ["explain", "--gpu", "b300", "--heads", "32:8", "--head-dim",
                                  "128", "--cache", str(tmp_path / "c"), "--json"])
    assert json.loads(r.output)["description"].startswith("sm103 "), r.output
