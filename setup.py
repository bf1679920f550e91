"""The one thing pyproject.toml does not declare: the C extensions. epp/prefix/_native.c holds the
prefix-cache index's two hot loops (hashing, table lookup); epp/wire/_fast.c the read path of the
ext_proc connections, which answers streamed response chunks without Python (see each file for why)."""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11"]

setup(
    ext_modules=[
        Extension("epp.prefix._native", ["epp/prefix/_native.c"], extra_compile_args=_FLAGS),
        Extension("epp.wire._fast", ["epp/wire/_fast.c"], extra_compile_args=_FLAGS, libraries=["ssl", "crypto"]),
    ]
)
