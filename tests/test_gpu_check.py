"""`make gpu-check` without a GPU: benchmarks/gpu_check.py's CPU twin passes and fails when
it must. Its verdict ([Note: the training verdict]) passes the unperturbed runs and fails
every negative control, in bf16 and fp16, at world 1 and 2, against float64 references that
really differ; the perf section's probes and .ci/gpu_check.sh's phases run; a section that
raises or runs out of time fails the run (issues 23 and 37)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

import gpu_check  # noqa: E402


def _run(args, env=None, timeout=300):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- the verdict's arithmetic ---------------------------------------------------------

def _refs(e32: float, eamp: float, steps: int = 4):
    """float64/fp32/autocast references of one 1-D and one 2-D tensor whose fp32 and
    autocast runs are e32 and eamp from float64 (in every quantity)."""
    g = torch.Generator().manual_seed(0)
    base = {"tensors": {}, "steps": {}}
    for name, shape in (("w", (8, 16)), ("b", (16,))):
        base["tensors"][name] = {q: torch.randn(shape, generator=g, dtype=torch.float64)
                                 for q in gpu_check.QUANTITIES}
        base["steps"][name] = float(steps)
    refs = {"float64": base}
    for kind, e in (("fp32", e32), ("bf16", eamp)):
        refs[kind] = {"distance": {(n, q): e for n in base["tensors"] for q in gpu_check.QUANTITIES}}
    return refs


def _off_by(refs, rel: float, name="w", quantity="update", steps=4):
    """A device result equal to float64 except ``name``'s ``quantity``, ``rel`` away from it."""
    base = refs["float64"]
    g = torch.Generator().manual_seed(1)
    out = {"tensors": {n: dict(t) for n, t in base["tensors"].items()}, "steps": {n: float(steps) for n in base["steps"]}}
    x = base["tensors"][name][quantity]
    noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
    out["tensors"][name][quantity] = x + rel * x.norm() * noise / noise.norm()
    return out


def test_bound_is_fp32_plus_allowance_times_autocast():
    refs = _refs(e32=0.001, eamp=0.02)
    bound = 0.001 + gpu_check.ALLOWANCE * 0.02
    inside = gpu_check.compare(_off_by(refs, 0.98 * bound), refs, "bf16", 4)
    assert inside["ok"], inside["problems"]
    assert abs(inside["worst"]["ratio"] - 0.98) < 1e-9 and inside["worst"]["tensor"] == "w"
    outside = gpu_check.compare(_off_by(refs, 1.02 * bound, name="b", quantity="exp_avg"), refs, "bf16", 4)
    assert not outside["ok"]
    assert outside["problems"] == [f"b exp_avg: {1.02 * bound:.3g} from float64 > {bound:.3g} (fp32 0.001 + "
                                   f"{gpu_check.ALLOWANCE:g} x autocast 0.02)"]


def test_step_counters_and_missing_state_fail():
    refs = _refs(e32=0.0, eamp=0.1)
    skipped = gpu_check.compare(_off_by(refs, 0.0, steps=3), refs, "bf16", 4)
    assert not skipped["ok"] and "step counters of 2 parameters are ['3.0'], not 4" in skipped["problems"][0]
    missing = _off_by(refs, 0.0)
    del missing["tensors"]["b"]["exp_avg_sq"]
    res = gpu_check.compare(missing, refs, "bf16", 4)
    assert not res["ok"] and res["problems"] == ["b exp_avg_sq: missing or of another shape on the device"]
    zero_ref = _refs(e32=0.0, eamp=0.0)  # a bound of 0: only the exact value passes
    assert gpu_check.compare(_off_by(zero_ref, 0.0), zero_ref, "bf16", 4)["ok"]
    assert not gpu_check.compare(_off_by(zero_ref, 1e-12), zero_ref, "bf16", 4)["ok"]


def test_each_perturbation_changes_what_it_names():
    refs = _refs(e32=0.0, eamp=0.0)
    dev = _off_by(refs, 0.0)
    before = {n: {q: x.clone() for q, x in t.items()} for n, t in dev["tensors"].items()}
    d = gpu_check.distances
    base = refs["float64"]
    for name, expect in (("no update (lr=0)", {("w", "update"): 1.0, ("b", "update"): 1.0}),
                         ("updates x1.15", {("w", "update"): 0.15, ("b", "update"): 0.15}),
                         ("updates x0.8", {("w", "update"): 0.2, ("b", "update"): 0.2}),
                         ("1-D not updated", {("b", "update"): 1.0}),
                         ("1-D wrong sign", {("b", "update"): 2.0}),
                         ("1-D updated 3x", {("b", "update"): 2.0})):
        got = d(gpu_check.PERTURBATIONS[name](dev), base)
        for key, value in got.items():
            assert value == pytest.approx(expect.get(key, 0.0), abs=1e-12), (name, key)
    unwritten = d(gpu_check.PERTURBATIONS["10% of exp_avg unwritten"](dev), base)
    for n in ("w", "b"):  # every 10th element zeroed: about sqrt(0.1) of the norm
        assert 0.15 < unwritten[(n, "exp_avg")] < 0.6
    for n, t in dev["tensors"].items():  # the case's own result is left alone
        assert all(torch.equal(x, before[n][q]) for q, x in t.items())


def test_assemble_joins_pieces_and_names_what_is_wrong():
    import numpy as np

    a = np.arange(6, dtype=np.float32)
    whole, problems = gpu_check.assemble([[("model/w", (2, 3), 0, a[:4], False), ("optim/0/w/step", (), 0, np.ones(1), True)],
                                          [("model/w", (2, 3), 4, a[4:], False), ("optim/0/w/step", (), 0, np.ones(1), True)]])
    assert problems == [] and whole["model/w"].shape == (2, 3) and whole["model/w"].reshape(-1).tolist() == a.tolist()
    _, problems = gpu_check.assemble([[("model/w", (2, 3), 0, a[:4], False)]])
    assert problems == ["model/w: 2 of 6 elements held by no rank"]
    _, problems = gpu_check.assemble([[("model/w", (6,), 0, a, True)], [("model/w", (6,), 0, a + 1, True)]])
    assert problems == ["model/w: rank 1's replica differs from rank 0's (max |diff| 1)"]


# ---- the CPU twin, whole: every backend passes, every control fails --------------------

def test_cpu_twin_passes_with_its_negative_controls(tmp_path, capsys, monkeypatch):
    """The CLI as `make gpu-check` runs it, on the CPU (world-2 ranks from the test harness)."""
    monkeypatch.setattr(gpu_check, "WORLD2_RUNNER", _warm_runner())
    report = tmp_path / "report.md"
    code = gpu_check.main(["--device", "cpu", "--quick", "--only", "train", "--report", str(report)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, "\n".join(lines[-40:])
    cases = [line for line in lines if " world=" in line and line.startswith(("ok", "FAIL"))]
    # 6 backends x 2 precisions on one process, zero3 x 2 precisions on two
    assert len(cases) == 14 and all(line.startswith("ok") for line in cases), "\n".join(cases)
    n = len(gpu_check.PERTURBATIONS)
    for line in cases:
        assert f"controls {n}/{n} failed" in line, line
    assert any(line.startswith("phase train: ") for line in lines)
    text = report.read_text()
    assert text.startswith("# gpu-check report (passed)")
    assert "| zero3 fp16 world=2 | yes |" in text and "### Per tensor: single bf16 world=1" in text
    assert "## Peak memory per rank at world 2 (bf16)" in text
    assert f"report written to {report}" in lines[-1]


def _warm_runner():
    from harness import run_distributed

    return run_distributed


def test_really_broken_optimizers_fail_and_the_world2_reference_really_differs():
    """Every BROKEN optimizer, trained for real (single at world 1, ddp at world 2, bf16 and
    fp16), fails the verdict; the unbroken runs beside them pass. At world 2 the unbroken run
    is judged against float64 with the two ranks' batches as two micro-batches: a nonzero
    distance, not a copy of itself; ddp's two replicas are compared with each other."""
    cfg = gpu_check.Config("cpu", True)
    cfg.backends, cfg.world2, cfg.broken = ("single",), ("ddp",), True
    log = []
    rows = gpu_check.check_training(cfg, log.append, runner=_warm_runner())
    broken = [r for r in rows if r["broken"] is not None]
    assert len(broken) == 2 * 2 * len(gpu_check.BROKEN), "\n".join(log)
    for r in broken:
        assert r["ok"] and not r["verdict_ok"], r["name"]  # ok: it failed as it must
    clean = [r for r in rows if r["broken"] is None]
    assert [r["name"] for r in clean] == ["single bf16 world=1", "single fp16 world=1",
                                          "ddp bf16 world=2", "ddp fp16 world=2"]
    for r in clean:
        assert r["ok"], (r["name"], r["problems"])
        assert all(c["failed"] for c in r["controls"].values())
        updates = [x["e"] for x in r["rows"] if x["quantity"] == "update"]
        assert min(updates) > 0 and max(updates) > 0.01, (r["name"], updates)  # not a copy of itself
    # the perf section's world-2 probe ran on both ranks (bf16)
    assert [m["rank"] for m in clean[2]["rank_memory"]] == [0, 1] and "rank_memory" not in clean[3]


def test_a_broken_optimizer_that_passes_fails_the_run(monkeypatch):
    """The self-check of --broken: if a broken optimizer were as good as AdamW (here one that
    is AdamW), its case fails, naming it."""
    monkeypatch.setitem(gpu_check.BROKEN, "updates x0.8", lambda params, lr: torch.optim.AdamW(params, lr=lr))
    cfg = gpu_check.Config("cpu", True)
    refs = gpu_check.references(cfg, 1, lambda line: None)
    run = gpu_check.train(cfg, "single", "bf16", broken="updates x0.8")
    res = gpu_check.evaluate(cfg, "single bf16 world=1 broken[updates x0.8]", [run], refs, "bf16", "updates x0.8")
    assert not res["ok"] and res["problems"] == ["the broken optimizer 'updates x0.8' PASSED the verdict: it cannot see it"]


def test_one_dim_breakage_is_refused_on_flat_shards():
    cfg = gpu_check.Config("cpu", True)
    with pytest.raises(ValueError, match=r"perturbs 1-D parameters, but it steps \d+ tensors for 30 parameters \(flat shards\)"):
        gpu_check.train(cfg, "zero2", "bf16", broken="1-D not updated")


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
    reads = {"aten::_local_scalar_dense": cfg.steps - cfg.warmup}
    assert all(r["problems"] == [f"host syncs in the step: reads {reads}, sync-debug errors []"] for r in rows), lines


# ---- the perf section and loud failures -------------------------------------------------

def test_perf_section_measures_against_plain_amp():
    cfg = gpu_check.Config("cpu", True)
    cfg.backends = ("zero3",)
    lines = []
    rows = gpu_check.bench_perf(cfg, lines.append)
    assert [(r["backend"], r["precision"]) for r in rows] == [("zero3", "bf16"), ("zero3", "fp16")]
    for r in rows:
        assert r["ok"] and r["torch_ms"] > 0 and r["mixprec_ms"] > 0
        assert r["time_ratio"] == pytest.approx(r["mixprec_ms"] / r["torch_ms"])
        assert "GradScaler" in r["versus"] if r["precision"] == "fp16" else "GradScaler" not in r["versus"]
    assert len(lines) == 2 and all(line.startswith("perf ") for line in lines)


class _FakeCudaMemory:
    def __init__(self, allocated, peak):
        self.allocated, self.peak, self.calls = allocated, peak, []

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda d=None: self.calls.append("sync"))
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: self.calls.append("reset"))
        monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: self.peak)


def test_cuda_peak_probe_reads_above_its_base_and_fails_loudly_on_nothing(monkeypatch):
    fake = _FakeCudaMemory(allocated=1000, peak=5096)
    fake.install(monkeypatch)
    probe = gpu_check.PeakMemory("cuda:0")
    with pytest.raises(RuntimeError, match="before start"):
        probe.read()
    probe.start()
    assert fake.calls == ["sync", "empty_cache", "reset"]
    assert probe.read() == 4096 and probe.method == "torch.cuda.max_memory_allocated"
    fake.peak = 1000
    with pytest.raises(RuntimeError, match="rose by 0 bytes over a training run on cuda:0"):
        probe.read()


def test_a_section_that_raises_fails_the_run(monkeypatch, capsys, tmp_path):
    def broken_perf(cfg, log):
        raise KeyError("no such backend")

    monkeypatch.setattr(gpu_check, "bench_perf", broken_perf)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "perf", "--report", str(tmp_path / "r.md")]) == 1
    out = capsys.readouterr().out
    assert "FAIL section perf raised" in out and "KeyError: 'no such backend'" in out
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("# gpu-check report (FAILED)") and "## Sections that raised or did not run" in text


def test_the_time_budget_fails_what_it_leaves(capsys):
    # out of time before a section: the section is reported as not run
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "train", "--budget-s", "1e-9"]) == 1
    assert "FAIL train: not run, the time budget ran out (--budget-s)" in capsys.readouterr().out
    # out of time between cases: every case left, and every world-2 backend, fails as not run
    cfg = gpu_check.Config("cpu", True)
    cfg.backends, cfg.world2, cfg.deadline = ("single", "zero3"), ("zero3",), 0.0
    rows = gpu_check.check_training(cfg, lambda line: None, runner=lambda *a, **k: pytest.fail("started"))
    assert len(rows) == 6 and all(not r["ok"] for r in rows)
    assert all(r["problems"] == ["not run: the time budget ran out (--budget-s)"] for r in rows)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--budget-s", "-1"])
    with pytest.raises(ValueError, match=r"broken='typo' is not one of"):
        gpu_check.make_optimizer([torch.nn.Parameter(torch.zeros(1))], 1e-3, "typo")


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


def test_gpu_check_sh_dry_run_times_each_phase_and_runs_only_cuda_tests(tmp_path):
    report = tmp_path / "report.md"
    out = _run(["bash", ".ci/gpu_check.sh", "--dry-run"],
               env={"GPU_PYTHON": sys.executable, "GPU_CHECK_REPORT": str(report), "GPU_CHECK_CUDA_ARCHS": "89"})
    assert out.returncode == 0, out.stdout + out.stderr
    would = [line for line in out.stdout.splitlines() if line.startswith("gpu-check: would run:")]
    assert len(would) == 3, out.stdout
    assert "cmake.define.MIXPREC_CUDA_ARCHS=89" in would[0] and "build-dir=build/gpu" in would[0]
    assert " -m cuda tests/kernels tests/test_gpu_paths.py" in would[1]
    assert f"benchmarks/gpu_check.py --device cuda --budget-s 240 --report {report}" in would[2]
    for phase in ("venv", "build", "cuda-tests", "gpu_check"):
        assert f"gpu-check: phase {phase}: " in out.stdout
    text = report.read_text()
    assert text.startswith("# gpu-check report (dry run")
    assert "| cuda-tests | 0 | ok |" in text and "| total |" in text
    assert out.stdout.rstrip().endswith(f"report: {report}")


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
