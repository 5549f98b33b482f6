"""The example script runs as written (on a small subset). The LangChain and LlamaIndex examples are the notebooks
(tests/test_notebooks.py executes them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quickstart():
    out = _run("quickstart.py", "--queries", "1", "--max-new-tokens", "16")
    assert "tokens/step" in out
