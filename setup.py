"""The C build of rag_accel's hot matching loops (``rag_accel/_native.c``); everything else is in pyproject.toml.

Optional: where no C compiler is found the build goes on without it and ``rag_accel.kernels`` runs its Python (the
same drafts, more host time per step).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rag_accel._native", ["rag_accel/_native.c"], optional=True)])
