"""``mixprec test``: the 2-process self-check passes (ddp and zero2, bf16) and prints PASS."""

import subprocess
import sys


def test_mixprec_test_passes():
    proc = subprocess.run([sys.executable, "-m", "mixprec", "test", "--steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "PASS"
    for backend in ("ddp", "zero2"):
        row = next(line for line in lines if line.startswith(backend))
        assert "ranks agree: yes" in row and row.endswith("PASS")


def test_selftest_fails_past_its_tolerance(monkeypatch):
    from mixprec import selftest

    monkeypatch.setattr(selftest, "TOLERANCE", 0.0)  # bf16 on half batches cannot match bit for bit
    ok, line = selftest.check("ddp", steps=2)
    assert not ok and line.endswith("FAIL") and "ranks agree: yes" in line
