"""Builds the C++17/OpenMP extension ``nelssa._C`` from ``csrc/``.

NELSSA_ARCH selects the ISA: ``native`` (default, the build machine's, e.g. AVX-512),
``portable`` (x86-64-v2 / armv8-a: scalar + SSE code paths), or any ``-march`` value.
Without torch (or with NELSSA_NO_EXT=1) the package installs without the extension and
every kernel falls back to its pure-torch path.
"""

import glob
import os
import platform
import sys

from setuptools import setup


def _arch_flags():
    arch = os.environ.get("NELSSA_ARCH", "native")
    if arch == "portable":
        return ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else ["-march=armv8-a"]
    return [f"-march={arch}"]


def _shared_libstdcxx():
    """Link args that make the extension use the process's shared libstdc++ (the one torch uses).

    Some toolchains link libstdc++ statically into extensions (``-static-libstdc++`` in the Python
    build's flags, or only ``libstdc++.a`` on the compiler's path): the extension then carries a
    private copy, and its iostreams crashed on the threads it starts itself (the node's device
    workers, formatting an error message on the H200 host). Naming the shared object first leaves
    the static archive nothing to supply."""
    import shutil
    import subprocess
    import sysconfig
    cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
    if not shutil.which(cxx):
        return []
    try:
        path = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [os.path.realpath(path)] if os.path.isabs(path) and os.path.exists(path) else []


def _ext():
    if os.environ.get("NELSSA_NO_EXT") == "1":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("nelssa: torch not importable, building without nelssa._C", file=sys.stderr)
        return {}
    ext = CppExtension(
        "nelssa._C",
        sorted(glob.glob("csrc/*.cpp")),
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=fast", *_arch_flags()],
        extra_link_args=["-fopenmp", "-ldl", *_shared_libstdcxx()],
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_ext())
