"""Runs interpreted_moe.py (the expert kernels), interpreted_dense.py (the dense decode
kernels), interpreted_qlinear.py (the projection GEMV), interpreted_decode.py (router top-k,
attention) and engine/interpreted_fused_decode.py (a whole fused decode step) on CPU, through
Triton's interpreter, each in a child process with TRITON_INTERPRET=1
set for that process only: Triton reads it at import."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
@pytest.mark.parametrize(
    "script",
    [
        "interpreted_moe.py",
        "interpreted_dense.py",
        "interpreted_qlinear.py",
        "interpreted_decode.py",
        "../engine/interpreted_fused_decode.py",
    ],
)
def test_triton_kernels_under_the_interpreter(script):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=here.parent.parent, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
