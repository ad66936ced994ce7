"""Every copy of the CPU kernels this build and this CPU have passes the same tests.

The extension picks the widest compiled capability the CPU runs (see [Note: CPU
capabilities] in csrc/kernels/cpu/items.h); MIXPREC_CPU_CAPABILITY caps it. The plain test
run covers the widest copy (checked here: it is the one the CPU's flags allow), these runs
each narrower one, in a fresh process (the choice is made once per process), and check
that the process really ran the copy asked for (``_C.cpu_kernel_capability()``). A copy the
CPU cannot run (AVX-512 on a CPU without it) is skipped, naming the CPU's flags.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec import _C

HERE = Path(__file__).parent
# Every file of CPU kernel tests (test_kernels_cuda.py needs a GPU; this file is the runner).
FILES = ["test_kernels_copy.py", "test_kernels_unscale.py", "test_kernels_optim.py", "test_kernels_inline.py",
         "test_kernels_step_counters.py"]
ORDER = ["DEFAULT", "AVX2", "AVX512"]


def _flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _widest() -> str:
    """What csrc/kernels/cpu/launcher.cpp's cpu_capability() picks from the CPU's flags."""
    f = _flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= f:
        return "AVX512"
    if {"avx2", "fma", "f16c"} <= f:
        return "AVX2"
    return "DEFAULT"


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/cpuinfo; POSIX subprocess env")


def test_the_plain_run_uses_the_widest_copy_the_cpu_runs():
    if os.environ.get("MIXPREC_CPU_CAPABILITY") or os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("the capability is capped by the environment")
    assert _C.cpu_kernel_capability() == _widest(), sorted(_flags())


@pytest.mark.parametrize("cap", ["default", "avx2"])
def test_kernel_tests_pass_under_capability(cap):
    widest = _widest()
    if ORDER.index(cap.upper()) >= ORDER.index(widest):
        pytest.skip(f"{cap.upper()} is this CPU's widest copy ({widest}): the plain run tests it")
    env = dict(os.environ, MIXPREC_CPU_CAPABILITY=cap)
    picked = subprocess.run([sys.executable, "-c", "from mixprec import _C; print(_C.cpu_kernel_capability())"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert picked.stdout.strip() == cap.upper(), (picked.stdout, picked.stderr[-2000:])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *FILES], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
