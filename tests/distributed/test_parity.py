"""mixprec.parity_check: sound configurations pass on every backend; a broken one is caught."""

import subprocess
import sys

import pytest
import torch

from mixprec import parity_check
from mixprec.parity import demo_batch, demo_model

BACKENDS = ["single", "ddp", "zero1", "zero2", "zero3", "fsdp"]


@pytest.fixture
def warm_ranks(monkeypatch):
    """parity_check's runs on the suite's warm ranks (tests/distributed/harness.py) instead of
    fresh processes per backend: these tests check its verdicts, not process start-up (the CLI
    test below still goes through mixprec.distributed.spawn)."""
    import mixprec.parity as parity_module
    from harness import run_distributed

    monkeypatch.setattr(parity_module, "run_distributed", run_distributed)


def test_bf16_parity_over_all_backends_passes(warm_ranks):
    report = parity_check(demo_model, demo_batch, BACKENDS, steps=10, mixed_precision="bf16")
    assert report.passed, report.format()
    assert [t.backend for t in report.traces] == BACKENDS
    assert report.reference.mixed_precision == "no" and report.reference.world_size == 1
    assert all(len(t.losses) == 10 for t in report.traces)
    assert report.traces[1].world_size == 2


def small_lr_adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def test_catches_bf16_weights_updated_without_fp32_masters(warm_ranks):
    # [Note: parity tolerances] in mixprec/parity.py: with lr 1e-4 most updates are below
    # half a bf16 ulp, so bf16 weights updated in place stop following the fp32 run.
    broken = parity_check(demo_model, demo_batch, ["single"], steps=20, mixed_precision="bf16-pure",
                          optimizer_fn=small_lr_adamw)
    sound = parity_check(demo_model, demo_batch, ["single"], steps=20, mixed_precision="bf16",
                         optimizer_fn=small_lr_adamw)
    assert not broken.passed, broken.format()
    assert sound.passed, sound.format()
    assert "FAIL" in broken.format()


def test_cli_reports_and_sets_the_exit_code():
    out = subprocess.run([sys.executable, "-m", "mixprec", "parity", "--backends", "single", "--steps", "3",
                          "--mixed-precision", "fp16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PASS" in out.stdout and "single" in out.stdout


def test_bad_backend_is_named():
    with pytest.raises(ValueError, match="backend 'zero9' is not one of"):
        parity_check(demo_model, demo_batch, ["zero9"], steps=1)
