"""The DEFAULT and AVX2 copies of the CPU kernels pass the same tests.

The extension picks the widest compiled capability the CPU runs (see [Note: CPU
capabilities] in csrc/kernels/cpu/items.h); MIXPREC_CPU_CAPABILITY caps it. The
plain test run covers the widest copy, these runs the narrower ones, each in
a fresh process (the choice is made once per process).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FILES = ["test_kernels_copy.py", "test_kernels_unscale.py", "test_kernels_optim.py"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX subprocess env")
@pytest.mark.parametrize("cap", ["default", "avx2"])
def test_kernel_tests_pass_under_capability(cap):
    env = dict(os.environ, MIXPREC_CPU_CAPABILITY=cap)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *FILES], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
