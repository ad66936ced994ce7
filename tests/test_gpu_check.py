"""`make gpu-check` without a GPU: benchmarks/gpu_check.py's CPU twin passes and fails when
it must, its comparison and tolerance do what [Note: training tolerance] says, and
.ci/gpu_check.sh refuses a machine without CUDA and builds its venv from a python that is
itself a venv (issue 23)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _run(args, env=None, timeout=240):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- the comparison -------------------------------------------------------------------

def _fake_run(update, exp_avg, steps):
    init = {"w": torch.zeros(1000)}
    return {"init": init, "final": {"w": init["w"] + update},
            "state": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg ** 2, "step": steps}}


def test_tolerance_is_the_stated_arithmetic():
    assert gpu_check.tolerance("bf16", 8) == 8 * 2.0 ** -8 * 8 == 0.25
    assert gpu_check.tolerance("fp16", 8) == 8 * 2.0 ** -11 * 8


def test_compare_passes_within_and_fails_outside_the_tolerance():
    g = torch.Generator().manual_seed(0)
    update = torch.randn(1000, generator=g) * 1e-3
    noise = torch.randn(1000, generator=g)
    noise = noise / noise.norm()
    ref = _fake_run(update, update * 10, [4.0])
    tol = 0.1
    near = _fake_run(update + 0.5 * tol * update.norm() * noise, update * 10, [4.0])
    far = _fake_run(update + 2 * tol * update.norm() * noise, update * 10, [4.0])
    assert gpu_check.compare(near, ref, tol)["ok"]
    bad = gpu_check.compare(far, ref, tol)
    assert not bad["ok"] and bad["problems"][0].startswith("params differ by 0.2")
    assert abs(bad["metrics"]["params"] - 0.2) < 1e-6
    frozen = gpu_check.compare(_fake_run(update * 0, update * 10, [4.0]), ref, tol)  # lr=0
    assert not frozen["ok"] and frozen["metrics"]["params"] == 1.0
    skipped = gpu_check.compare(_fake_run(update, update * 10, [3.0]), ref, tol)
    assert not skipped["ok"] and "step counters differ" in skipped["problems"][0]
    state_off = gpu_check.compare(_fake_run(update, update * 13, [4.0]), ref, tol)
    assert not state_off["ok"] and any(p.startswith("exp_avg differ") for p in state_off["problems"])


# ---- the CPU twin, whole, and with a broken optimizer ---------------------------------

def test_cpu_twin_passes_with_its_negative_controls(tmp_path):
    report = tmp_path / "report.md"
    # the step-time section is a report, not a check: left out to keep this test short
    out = _run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
                "--only", "train", "--only", "kernels", "--report", str(report)])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    cases = [line for line in lines if " world=" in line]
    # 6 backends x 2 precisions on one process, zero3 x 2 precisions on two
    assert len(cases) == 14 and all(line.startswith("ok") for line in cases), "\n".join(cases)
    for line in cases:  # the lr=0 control differs by the whole update
        assert "control lr=0 params 1.00e+00" in line, line
    kernels = [line for line in lines if " kernel " in line]
    assert len(kernels) >= 7 and all(line.startswith("ok") for line in kernels), "\n".join(kernels)
    text = report.read_text()
    assert text.startswith("# gpu-check report (passed)") and "| zero3 fp16 world=2 | yes |" in text
    assert f"report written to {report}" in out.stdout


class _NoStep(torch.optim.AdamW):
    """Says it stepped, changes nothing (what G1 did on CUDA: counters on, update off)."""

    def step(self, closure=None):
        return None


@pytest.mark.parametrize("broken", ["doubled_lr", "no_step"])
def test_a_broken_optimizer_on_the_device_side_fails_the_check(monkeypatch, broken):
    def make_optimizer(params, lr, side):
        if side == "device":
            return torch.optim.AdamW(params, lr=2 * lr) if broken == "doubled_lr" else _NoStep(params, lr=lr)
        return torch.optim.AdamW(params, lr=lr)

    monkeypatch.setattr(gpu_check, "make_optimizer", make_optimizer)
    result = gpu_check.check_case(gpu_check.Config("cpu", True), "single", "bf16")
    assert not result["ok"]
    assert any(p.startswith("params differ by") for p in result["problems"]), result["problems"]
    if broken == "no_step":
        assert any("step counters differ" in p for p in result["problems"]), result["problems"]


def test_the_unbroken_case_passes_in_process():
    result = gpu_check.check_case(gpu_check.Config("cpu", True), "zero2", "fp16")
    assert result["ok"], result["problems"]
    assert result["metrics"]["params"] <= result["tolerance"]
    assert result["control"]["failed"] and result["control"]["metrics"]["params"] == 1.0


def test_kernel_checks_fail_on_a_wrong_kernel(monkeypatch):
    from mixprec import kernels

    real = kernels.copy_cast_

    def off_by_one_ulp(dsts, srcs):
        real(dsts, srcs)
        for d in dsts:
            d.view(torch.int16).add_(1)

    monkeypatch.setattr(kernels, "copy_cast_", off_by_one_ulp)
    lines = []
    rows = gpu_check.check_kernels(gpu_check.Config("cpu", True), lines.append)
    by_name = {r["name"]: r for r in rows}
    assert not by_name["copy_cast_ fp32->bf16"]["ok"]
    assert all(r["ok"] for n, r in by_name.items() if n != "copy_cast_ fp32->bf16"), lines


# ---- .ci/gpu_check.sh -----------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_sh_exits_2_without_a_cuda_device(tmp_path):
    out = _run(["bash", ".ci/gpu_check.sh"], env={"GPU_PYTHON": sys.executable,
                                                  "GPU_VENV": str(tmp_path / "never-made")})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA device visible to" in out.stderr and "GPU_PYTHON" in out.stderr
    assert not (tmp_path / "never-made").exists()


def test_gpu_check_py_exits_2_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    assert gpu_check.main(["--device", "cuda"]) == 2


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run from a venv (make test's .venv)")
def test_gpu_check_sh_builds_its_venv_from_a_python_that_is_a_venv(tmp_path):
    venv = tmp_path / "gv"
    env = {"GPU_PYTHON": sys.executable, "GPU_VENV": str(venv)}
    out = _run(["bash", ".ci/gpu_check.sh", "--venv-only"], env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith(f"{venv}/bin/python")
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    assert str(Path(sys.prefix)) not in cfg  # made from the base interpreter, not from the venv
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sys, torch, scikit_build_core, pip, pytest; print(sys.prefix); print(torch.__file__)"],
        capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    prefix, torch_file = probe.stdout.split()
    assert Path(prefix) == venv
    assert Path(torch_file).resolve().is_relative_to(Path(sys.prefix).resolve())  # the parent venv's torch
    # a second run reuses it (same interpreter: same stamp)
    marker = venv / "marker"
    marker.write_text("kept")
    again = _run(["bash", ".ci/gpu_check.sh", "--venv-only"], env=env)
    assert again.returncode == 0 and marker.exists()


def test_gpu_check_sh_rejects_an_unknown_argument():
    out = _run(["bash", ".ci/gpu_check.sh", "--fast"])
    assert out.returncode == 64 and "unknown argument '--fast'" in out.stderr


def test_a_host_read_in_the_step_fails_the_case(monkeypatch):
    import _common

    real = _common.lm_loss

    def reading_loss(logits, target):
        loss = real(logits, target)
        float(loss.detach())  # a host read, as a logging line would add
        return loss

    monkeypatch.setattr(_common, "lm_loss", reading_loss)
    cfg = gpu_check.Config("cpu", True)
    cfg.backends, cfg.world2 = ("single",), ()
    lines = []
    rows = gpu_check.check_training(cfg, lines.append)
    assert [r["ok"] for r in rows] == [False, False], lines
    assert all("host syncs in the step: reads {'aten::_local_scalar_dense': 2}" in p
               for r in rows for p in r["problems"]), lines
