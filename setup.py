"""The one thing pyproject.toml does not declare: the C extension, the prefix-cache index's two hot
loops (hashing, table lookup; see epp/prefix/_native.c for why they are in C)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("epp.prefix._native", ["epp/prefix/_native.c"], extra_compile_args=["-O3", "-std=c11"])])
