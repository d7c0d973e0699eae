"""The SM target of the cubins embedded in an exported kernel object, read on the CPU.

`export_to_c` embeds the kernel's cubin (an ELF of machine EM_CUDA) in the host object's
read-only data. A build configured for the wrong target (CUTE_DSL_ARCH, or a DSL that ignores
it) still links and publishes, and fails only when a GPU loads it ("no kernel image is
available"), or, worse, loads a kernel tuned for the other chip. So every sm100/sm103
artifact's cubin target is checked here, where CI can see it (tests/fa4/test_cubin.py), with no GPU
and no CUDA tool: the ELF header alone says the SM.

Header flags (e_flags; cuobjdump -sass prints them as `.headerflags`):
- ABI version 8 (the cu13 DSL writes it for every target): SM number in bits 8-15. The
  arch-specific ("a") mark, which cuobjdump prints as EF_CUDA_ACCELERATORS, was bit 1 in the
  sm_100a and sm_103a cubins built here (e_flags 0x6006402, 0x6006702) and bit 2 in the sm_90a
  ones (0x6005a04): either counts. No family ("f") cubin was seen, so none is decoded.
- ABI version 7 and older: SM number in bits 0-7, "a" mark bit 11 (EF_CUDA_ACCELERATORS_V7).
tests/fa4/test_cubin.py also asks cuobjdump for its reading when one is installed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

EM_CUDA = 190
_ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class Cubin:
    offset: int  # where the cubin starts in the file
    size: int
    abi_version: int
    flags: int
    sm: int  # e.g. 100, 103, 90
    arch_specific: bool  # "a" target: loads only on its exact compute capability

    @property
    def target(self) -> str:
        """sm_100a / sm_100, as nvcc and CUTE_DSL_ARCH spell targets."""
        return f"sm_{self.sm}" + ("a" if self.arch_specific else "")


def _decode(flags: int, abi_version: int) -> tuple[int, bool]:
    if abi_version >= 8:
        return (flags >> 8) & 0xFF, bool(flags & 0x6)
    return flags & 0xFF, bool(flags & 0x800)


def embedded_cubins(data: bytes) -> list[Cubin]:
    """Every 64-bit little-endian EM_CUDA ELF image inside `data` (a .o or .so), in order.

    The host object is itself an ELF (x86-64): only images whose e_machine is EM_CUDA count."""
    out = []
    i = data.find(_ELF_MAGIC)
    while i >= 0:
        if len(data) >= i + 64 and data[i + 4] == 2 and data[i + 5] == 1:
            (machine,) = struct.unpack_from("<H", data, i + 18)
            if machine == EM_CUDA:
                phoff, shoff, flags = struct.unpack_from("<QQI", data, i + 32)
                phes, phnum, shes, shnum = struct.unpack_from("<HHHH", data, i + 54)
                size = max(phoff + phes * phnum, shoff + shes * shnum)
                abi = data[i + 8]
                sm, a = _decode(flags, abi)
                out.append(Cubin(i, size, abi, flags, sm, a))
        i = data.find(_ELF_MAGIC, i + 1)
    return out


def cubin_targets(path: str | Path) -> list[Cubin]:
    return embedded_cubins(Path(path).read_bytes())


def target_problem(path: str | Path, expected: str) -> str | None:
    """Why the object at `path` does not carry exactly `expected` cubins (e.g. "sm_100a"), or
    None. An object with no cubin at all is a problem too: the kernel would have nothing to
    load."""
    found = cubin_targets(path)
    if not found:
        return f"{path}: no embedded cubin (EM_CUDA ELF) found"
    wrong = sorted({c.target for c in found} - {expected})
    if wrong:
        return f"{path}: cubin target {', '.join(wrong)}, expected {expected}"
    return None


EIATTR_REGCOUNT = 0x2F  # .nv.info attribute: (symbol index u32, registers per thread u32)


def register_counts(path: str | Path) -> list[int]:
    """Registers per thread at launch of every kernel in the cubins embedded in `path`
    (EIATTR_REGCOUNT of their .nv.info sections; cuobjdump --dump-resource-usage prints it as
    REG). With min CTAs per SM m, ptxas holds it to 65536 / (threads * m): the build's check
    that an occupancy asked for took effect (forwards.trace_wide_fold)."""
    data = Path(path).read_bytes()
    counts = []
    for c in embedded_cubins(data):
        img = data[c.offset: c.offset + c.size]
        (shoff,) = struct.unpack_from("<Q", img, 0x28)
        shes, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
        secs = [struct.unpack_from("<IIQQQQIIQQ", img, shoff + i * shes) for i in range(shnum)]
        names = secs[shstrndx][4]
        for name_off, _, _, _, off, size, *_ in secs:
            if not img[names + name_off:].startswith(b".nv.info"):
                continue
            i = off
            while i + 2 <= off + size:  # records: format u8, attribute u8, then by format
                fmt, attr = img[i], img[i + 1]
                if fmt == 4:  # u16 length, then that many bytes
                    (n,) = struct.unpack_from("<H", img, i + 2)
                    if attr == EIATTR_REGCOUNT and n == 8:
                        counts.append(struct.unpack_from("<I", img, i + 8)[0])
                    i += 4 + n
                else:  # 1: no value, 2: a u8, 3: a u16, in the record's last two bytes
                    i += 4
    return counts
