"""The compiled kernel library's one home (specdec/models/native.py): every function the C++ exports is
declared in kernels/specdec_kernels.h and to ctypes in native.SIGNATURES, the two alike; every kernel
file is built and keyed; the library and its checks' cache carry their names."""

import ctypes
import re

import torch

from specdec.models import int4, native


def _prototypes() -> dict[str, tuple[str, list[str]]]:
    """specdec_kernels.h's extern "C" block: {name: (return type, [parameter declarations])}."""
    text = (native.KERNELS / "specdec_kernels.h").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    block = text[text.index('extern "C" {') + len('extern "C" {'):]
    block = block[:block.index("}")]
    found = {}
    for declaration in block.split(";"):
        match = re.fullmatch(r"\s*(.+?)\b(specdec_\w+)\s*\((.*)\)\s*", declaration, re.DOTALL)
        if match:
            parameters = [p.strip() for p in match.group(3).split(",") if p.strip()]
            found[match.group(2)] = (" ".join(match.group(1).split()), parameters)
    return found


def _ctype(declaration: str):
    if "*" in declaration:
        return ctypes.c_void_p
    return {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}[declaration.split()[0]]


def test_every_exported_function_is_declared_once_in_the_header_and_to_ctypes_alike():
    prototypes = _prototypes()
    assert list(prototypes) == list(native.SIGNATURES)  # the same functions, in the same order
    for name, (returned, parameters) in prototypes.items():
        restype, argtypes = native.SIGNATURES[name]
        assert restype == {"void": None, "const char*": ctypes.c_char_p}[returned], name
        assert argtypes == [_ctype(parameter) for parameter in parameters], name
    defined = set()
    for source in native.SOURCES:
        defined |= set(re.findall(r"^[\w ]+?[\w*]\s*\b(specdec_\w+)\(", source.read_text(), re.MULTILINE))
    assert defined == set(prototypes)


def test_every_kernel_file_is_built_and_keyed():
    files = {path for path in native.KERNELS.iterdir() if path.suffix in (".cpp", ".h")}
    assert files == set(native.SOURCES) | set(native.HEADERS)
    assert all(path.suffix == ".cpp" for path in native.SOURCES)


def test_the_library_and_its_checks_carry_their_names(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    handle = native.library()  # (built in an earlier test's cache folder, maybe: the same key)
    assert handle._name.endswith(f"/kernels/specdec-kernels-{native.library_key()}.so")
    assert int4.checked_shapes({(32, 64)}) is None
    checks = (tmp_path / "kernel-checks.json").read_text()
    assert f"{native.library_key()}:32x64" in checks
    rows = torch.randn(3, 64)
    records = int4.pack_weight(torch.randn(32, 64)).records
    assert torch.equal(int4.kernel_linear(rows, records, 32)[1:2], int4.kernel_linear(rows[1:2], records, 32))
