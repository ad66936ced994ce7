import subprocess
import sys


def test_env_reports_versions_and_build():
    out = subprocess.run([sys.executable, "-m", "mixprec", "env"], capture_output=True, text=True, check=True)
    assert "built against torch" in out.stdout and "CUDA kernels built" in out.stdout
