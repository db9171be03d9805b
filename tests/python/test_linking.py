"""The extension's dynamic symbol table: it exports its init function only, so that the CUDA runtime
linked into it statically never binds to (or is interposed by) another library's copy loaded with
RTLD_GLOBAL, as PyTorch loads its own."""

from __future__ import annotations

import struct
import sys

import pytest

import handoff._handoff as extension

SHT_DYNSYM = 11
STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE = 1, 2, 10
STV_DEFAULT = 0
SHN_UNDEF = 0


def dynamic_symbols(path: str) -> tuple[set[str], set[str]]:
    """(exported, undefined) names in an ELF64 little-endian shared object's .dynsym."""
    with open(path, "rb") as f:
        image = f.read()
    assert image[:4] == b"\x7fELF" and image[4] == 2 and image[5] == 1, "expected ELF64 little-endian"
    (section_offset,) = struct.unpack_from("<Q", image, 0x28)
    entry_size, count = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, section_offset + i * entry_size) for i in range(count)]
    exported: set[str] = set()
    undefined: set[str] = set()
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != SHT_DYNSYM:
            continue
        strings_offset = sections[link][4]
        for at in range(offset + symbol_size, offset + size, symbol_size):  # entry 0 is null
            name_offset, info, other, index = struct.unpack_from("<IBBH", image, at)
            end = image.index(b"\0", strings_offset + name_offset)
            name = image[strings_offset + name_offset : end].decode()
            if index == SHN_UNDEF:
                undefined.add(name)
            elif info >> 4 in (STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE) and other & 3 == STV_DEFAULT:
                exported.add(name)
    return exported, undefined


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads an ELF symbol table")


def test_the_extension_exports_its_init_function_only():
    exported, _ = dynamic_symbols(extension.__file__)
    assert exported == {"PyInit__handoff"}, f"also exported: {sorted(exported - {'PyInit__handoff'})[:20]}"


def test_the_extension_takes_no_cuda_symbol_from_other_libraries():
    # The CUDA runtime is linked in statically and finds the driver itself (dlopen): any CUDA
    # symbol left undefined would be resolved against whichever copy the process loaded first.
    _, undefined = dynamic_symbols(extension.__file__)
    borrowed = sorted(name for name in undefined if name.startswith(("cu", "__cuda")))
    assert borrowed == []
