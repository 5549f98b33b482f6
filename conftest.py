"""Settings for every suite of a run from the repository root (tests/, the doctests, both adapters' tests)."""

from __future__ import annotations

import os

# Under pytest-xdist (the README's `python -m pytest -n 2 --dist loadgroup`): each worker computes on one thread,
# and so do the processes its tests start (CLI runs, notebook kernels): two workers share two cores instead of four
# OpenMP threads fighting over them (which made two suites run side by side far slower than one after the other).
# (Set before anything imports torch: xdist names the worker in the environment before loading conftests.)
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
