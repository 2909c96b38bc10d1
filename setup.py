"""The build step for asynctron's C modules (everything else is in pyproject.toml).

xxHash (vendored, `third_party/xxhash/`) is built with it; on x86 with its run-time dispatch,
so the digests run at AVX2 speed where the CPU has it, from a wheel built for the baseline ISA
(as the `xxhash` package builds it).
"""

import platform

from setuptools import Extension, setup

XXHASH = "third_party/xxhash"
sources = ["asynctron/_native.c", f"{XXHASH}/xxhash.c"]
define_macros = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append(f"{XXHASH}/xxh_x86dispatch.c")
    define_macros.append(("ASYNCTRON_XXH_X86_DISPATCH", "1"))

setup(ext_modules=[
    Extension("asynctron._native", sources, include_dirs=[XXHASH],
              define_macros=define_macros, extra_compile_args=["-O3"],
              depends=[f"{XXHASH}/xxhash.h", f"{XXHASH}/xxh_x86dispatch.h"]),
    Extension("asynctron.storage._pickle_costs", ["asynctron/storage/_pickle_costs.c"],
              extra_compile_args=["-O3"]),
    # no FMA contraction: the blend must round as megatron's helpers do
    Extension("asynctron.datasets.formats._blending_native", ["asynctron/datasets/formats/_blending.c"],
              extra_compile_args=["-O3", "-ffp-contract=off"]),
])
