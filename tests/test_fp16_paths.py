"""Both fp16 matmul paths on whatever CPU runs the suite (issue #46, point 2).

``cpu_fp16_matmul="auto"`` takes the widened fp32 GEMMs on a CPU without fp16 arithmetic
(AMD, Intel before Sapphire Rapids) and torch's own fp16 GEMM (oneDNN) on one with it, so
the rest of the suite tests one path per machine. Here the single-process fp16 training
tests run again under each setting, every fp16 product of a prepared model on that path
(tests/_fp16_path_plugin.py drops the size threshold below which both leave the product to
torch), and the run must really have taken it: widened GEMMs counted on ``fp32``, none on
``native``. ``mixprec env`` and ``mixprec config explain`` name the path ``auto`` takes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# The single-process files whose fp16 tests train a prepared model (-k fp16 picks them).
FILES = ["test_clip_in_step.py", "test_parity_single.py", "test_overflow.py", "test_master_weights.py",
         "test_scaler_iteration.py", "test_weight_casts.py", "test_autocast_composition.py", "test_nonfinite.py",
         "test_diagnostics_overflow.py"]


@pytest.mark.parametrize("path", ["fp32", "native"])
def test_fp16_training_tests_pass_on_each_matmul_path(path, tmp_path):
    report = tmp_path / "widened_calls"
    env = dict(os.environ, MIXPREC_CPU_FP16_MATMUL=path, MIXPREC_FP16_PATH_REPORT=str(report))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_fp16_path_plugin",
                        "-k", "fp16", *FILES], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
    calls = int(report.read_text())
    assert (calls > 0) == (path == "fp32"), (path, calls)


def test_env_and_explain_name_the_path_auto_takes():
    from mixprec.wrappers.half_gemm import cpu_has_fp16_arithmetic

    expected = "native" if cpu_has_fp16_arithmetic() else "fp32"
    env = subprocess.run([sys.executable, "-m", "mixprec", "env"], capture_output=True, text=True, timeout=300)
    assert env.returncode == 0, env.stderr
    line = next(l for l in env.stdout.splitlines() if l.startswith("fp16 matmul (auto)"))
    assert line.split()[3] == expected, line
    assert any(l.startswith("mixprec CPU kernels") for l in env.stdout.splitlines()), env.stdout
    explain = subprocess.run([sys.executable, "-m", "mixprec", "config", "explain"], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, MIXPREC_MIXED_PRECISION="fp16"))
    assert explain.returncode == 0, explain.stdout + explain.stderr
    assert f"fp16 matmuls on the CPU (cpu_fp16_matmul): {expected}" in explain.stdout, explain.stdout[-2000:]
