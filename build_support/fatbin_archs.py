"""Which GPU code an object file compiled by nvcc holds: ``sm_XX`` (machine code) and
``compute_XX`` (PTX), read from its embedded fat binaries. .ci/cuda_compile_check.sh uses it
to check that the kernels hold what build_support/cuda_archs.cmake asked for, without
cuobjdump (the CUDA compiler packages alone do not ship it).

Usage: python3 build_support/fatbin_archs.py FILE.o   -> prints e.g. "sm_75 sm_80 compute_120"

The layout read here (little-endian): a fat binary starts with the magic 0xBA55ED50, a u16
version, a u16 header size and a u64 size of the entries after the header; each entry starts
with a u16 kind (1 = PTX, 2 = ELF machine code), a u16 field, a u32 entry-header size and a
u64 payload size, and holds the arch (e.g. 90) as a u32 at byte 28 of its header.
"""

from __future__ import annotations

import struct
import sys

MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "compute", 2: "sm"}


def fatbin_archs(data: bytes) -> list[str]:
    found = []
    pos = data.find(MAGIC)
    while pos != -1:
        _version, header, size = struct.unpack_from("<HHQ", data, pos + 4)
        entry, end = pos + header, pos + header + size
        if end > len(data):
            raise ValueError(f"fat binary at byte {pos} runs past the end of the file")
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            if kind not in KINDS or entry_header < 32:
                raise ValueError(f"unexpected fat binary entry (kind {kind}, header {entry_header}) "
                                 f"at byte {entry}: not the layout this script reads")
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            found.append(f"{KINDS[kind]}_{arch}")
            entry += entry_header + payload
        pos = data.find(MAGIC, end)
    return sorted(set(found), key=lambda a: (int(a.split("_")[1]), a))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        archs = fatbin_archs(f.read())
    if not archs:
        print(f"{argv[0]}: no fat binary (was it compiled by nvcc with -gencode?)", file=sys.stderr)
        return 1
    print(" ".join(archs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
