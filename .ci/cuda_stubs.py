"""Stand-in NVIDIA runtime libraries for a CUDA build of torch on a machine without CUDA.

The torch wheels on the package registry are CUDA builds: their shared libraries name
``libcudnn.so.9``, ``libnccl.so.2``, ``libcublas.so.13`` ... as needed, so ``import torch``
fails where those libraries are absent. CI runs CPU tensors only, so it needs the libraries to
*load*, never to run: this script writes, for every needed library that neither torch's own
``lib`` folder nor the system linker path (``ldconfig -p``) holds, a small shared library into
torch's ``lib`` folder (on the RPATH of torch's libraries) that defines every symbol torch's
libraries take from it, each one a function that prints its name and aborts. A CPU run that
reached one of them would stop loudly rather than compute anything.

Usage: ``python .ci/cuda_stubs.py`` with the Python of the environment that holds torch
(imports nothing from torch; needs gcc, nm and readelf). Deterministic: the same torch
libraries give the same stand-ins. Prints one line per library written.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[(.+)\]")


def _run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def _needed(lib: pathlib.Path) -> list[str]:
    return _NEEDED.findall(_run("readelf", "-d", str(lib)))


def _version_needs(lib: pathlib.Path) -> dict[str, str]:
    """The symbol versions ``lib`` asks of other libraries: {version name: library}."""
    versions, library = {}, None
    for line in _run("readelf", "-V", str(lib)).splitlines():
        if m := re.search(r"File: (\S+)", line):
            library = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and library is not None:
            versions[m.group(1)] = library
    return versions


def _symbols(lib: pathlib.Path, *, undefined: bool) -> list[str]:
    """Dynamic symbols ``lib`` defines, or takes from others (strong references only: a weak
    one such as ``__gmon_start__`` may stay unresolved)."""
    flag = "--undefined-only" if undefined else "--defined-only"
    rows = [line.split() for line in _run("nm", "-D", flag, str(lib)).splitlines()]
    return [row[-1] for row in rows if row and (not undefined or row[-2] == "U")]


def _system_libraries() -> dict[str, str]:
    found = {}
    for line in _run("ldconfig", "-p").splitlines():
        if "=>" in line and "x86-64" in line:
            soname = line.split()[0]
            found.setdefault(soname, line.split("=>")[-1].strip())
    return found


def _stub_source(symbols: list[str]) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "__attribute__((noreturn)) static void einshard_ci_stub(const char *name) {",
        '    fprintf(stderr, "einshard CI stand-in library: %s called (no NVIDIA runtime here)\\n", name);',
        "    abort();",
        "}",
    ]
    lines += [f'void {s}(void) {{ einshard_ci_stub("{s}"); }}' for s in symbols]
    return "\n".join(lines) + "\n"


def main() -> int:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torch is not installed in this environment")
    lib_dir = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib"
    torch_libs = sorted(p for p in lib_dir.glob("*.so*") if p.is_file())
    system = _system_libraries()
    own = {p.name for p in torch_libs}
    needed = sorted({n for lib in torch_libs for n in _needed(lib)})
    missing = [n for n in needed if n not in own and n not in system]
    if not missing:
        print("every library torch needs is present")
        return 0
    # Symbols a missing library must define: those torch's libraries take from it by version
    # (``name@libcudnn.so.9``), and every unversioned one that nothing present defines.
    defined: set[str] = set()
    for path in [*torch_libs, *(system[n] for n in needed if n in system)]:
        defined.update(s.split("@")[0] for s in _symbols(pathlib.Path(path), undefined=False))
    wanted: set[str] = set()
    version_of: dict[str, str] = {}
    for lib in torch_libs:
        wanted.update(_symbols(lib, undefined=True))
        version_of.update(_version_needs(lib))
    unversioned = sorted(s for s in wanted if "@" not in s and s not in defined and not s.startswith("_ITM"))
    with tempfile.TemporaryDirectory() as tmp:
        for soname in missing:
            by_version: dict[str, set[str]] = {}
            for s in wanted:
                name, _, version = s.partition("@")
                if version and version_of.get(version.lstrip("@")) == soname:
                    by_version.setdefault(version.lstrip("@"), set()).add(name)
            symbols = sorted(set(unversioned).union(*by_version.values()))
            source = pathlib.Path(tmp, "stub.c")
            source.write_text(_stub_source(symbols))
            script = pathlib.Path(tmp, "stub.map")
            # The version nodes torch's libraries ask this library for (``libcudnn.so.9``,
            # ``NVSHMEM``, ...), each with its symbols; the first also takes the unversioned ones.
            nodes = [
                f"{v} {{ global: {' '.join(f'{n};' for n in sorted(names))}{' *;' if i == 0 else ''} }};"
                for i, (v, names) in enumerate(sorted(by_version.items()))
            ]
            script.write_text("\n".join(nodes) + "\n" if nodes else "{ global: *; };\n")
            out = lib_dir / soname
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-O0", "-o", str(out), f"-Wl,-soname,{soname}",
                 f"-Wl,--version-script={script}", str(source)],
                check=True,
            )
            print(f"{out}: {len(symbols)} symbols that abort when called")
    return 0


if __name__ == "__main__":
    sys.exit(main())
