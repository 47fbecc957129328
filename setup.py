"""Builds the Cython hot path in kafscale/_native."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "kafscale._native.core",
        ["kafscale/_native/core.pyx"],
        include_dirs=["kafscale/_native"],
        extra_compile_args=["-O3"],
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
