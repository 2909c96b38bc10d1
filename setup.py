"""The build step for asynctron's one C module (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("asynctron._native", ["asynctron/_native.c"],
                             include_dirs=["third_party/xxhash"], extra_compile_args=["-O2"],
                             depends=["third_party/xxhash/xxhash.h"])])
