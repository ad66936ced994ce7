"""Every example script trains a few steps in one process; mixprec.logging is rank-aware.

The two-process runs (zero2, bf16) are in tests/distributed/test_example_runs.py.
"""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec import Accelerator
from mixprec.logging import RANK_FORMAT, get_logger

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# A few steps of each, with its end-of-run evaluation kept small.
QUICK = {
    "digits_cnn.py": ["--steps", "4"],
    "char_gpt.py": ["--steps", "3", "--batch", "8", "--sample-chars", "4"],
    "denoiser.py": ["--steps", "4", "--samples", "32"],
}
# Multi-process only (tests/distributed/test_example_runs.py): not in the one-process runs.
DISTRIBUTED_ONLY = {"tp_llama.py": ["--steps", "40"], "long_context.py": ["--steps", "2"]}
FINAL = re.compile(r"^final: loss ([-\d.naif]+).*backend (\w+), (\d) process\(es\), (\S+?)[;,\s]", re.M)


def run_example(script: str, *extra: str, launcher: tuple = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *launcher, str(EXAMPLES / script), *{**QUICK, **DISTRIBUTED_ONLY}[script], *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def assert_final(out: subprocess.CompletedProcess, backend: str, processes: int, precision: str) -> float:
    found = FINAL.findall(out.stdout)
    assert len(found) == 1, out.stdout  # printed by the main process only
    loss, got_backend, got_processes, got_precision = found[0]
    assert (got_backend, int(got_processes), got_precision) == (backend, processes, precision), found[0]
    assert math.isfinite(float(loss)), out.stdout
    return float(loss)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_example_runs_single_process_and_saves_state(script, tmp_path):
    out = run_example(script, "--mixed-precision", "bf16", "--output-dir", str(tmp_path / "ckpt"))
    assert_final(out, "single", 1, "bf16")
    assert any((tmp_path / "ckpt").iterdir()), "save_state wrote nothing"
    assert "[rank 0/1] INFO" in out.stderr  # logged through mixprec.logging
    assert f"/{QUICK[script][1]} [" in out.stderr  # the tqdm bar


def test_denoiser_time_embedding_runs_in_fp32_under_bf16():
    """keep_fp32_modules keeps the denoiser's timestep embedding exact; without it, it is not."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        import denoiser
    finally:
        sys.path.remove(str(EXAMPLES))
    t = torch.arange(denoiser.T)
    exact = denoiser.SinusoidalTimeEmbedding(32)(t)
    assert exact.dtype == torch.float32
    assert denoiser.bf16_embedding_error(denoiser.SinusoidalTimeEmbedding(32)) > 0.2  # what bf16 costs

    def prepared_embedding(**kwargs):
        accelerator = Accelerator(mixed_precision="bf16", log_policy=False, **kwargs)
        model = accelerator.prepare(denoiser.NoisePredictor())
        with accelerator.autocast():
            return model.time(t).float()

    assert torch.equal(prepared_embedding(keep_fp32_modules=("SinusoidalTimeEmbedding",)), exact)
    assert (prepared_embedding() - exact).abs().max() > 0.1  # the same module under bf16 autocast


def test_config_file_decides_backend_and_precision(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("backend: single\nmixed_precision: fp16\n")
    out = run_example("digits_cnn.py", "--config", str(cfg))
    assert_final(out, "single", 1, "fp16")


def test_config_file_and_a_conflicting_flag_are_an_error(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("mixed_precision: fp16\n")
    cmd = [sys.executable, str(EXAMPLES / "digits_cnn.py"), "--steps", "1", "--config", str(cfg),
           "--mixed-precision", "bf16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "mixed_precision" in out.stderr and "fp16" in out.stderr and "bf16" in out.stderr


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_logger_records_carry_rank_and_follow_main_process_only(monkeypatch):
    base = logging.getLogger("mixprec-test-logging")
    capture = _Capture()
    base.addHandler(capture)
    try:
        log = get_logger("mixprec-test-logging", log_level="info")
        assert base.level == logging.INFO
        log.info("main %d", 1)
        log.debug("below the level")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        log.info("rank 1, main only")          # dropped: not the main process
        log.warning("rank 1, everyone", main_process_only=False)
        messages = [(r.getMessage(), r.rank, r.world_size) for r in capture.records]
        assert messages == [("main 1", 0, 1), ("rank 1, everyone", 1, 2)]
        assert capture.records[0].filename == Path(__file__).name  # the caller's line, not the adapter's
        assert logging.Formatter(RANK_FORMAT).format(capture.records[1]) == (
            "[rank 1/2] WARNING mixprec-test-logging: rank 1, everyone"
        )
    finally:
        base.removeHandler(capture)


def test_get_logger_rejects_bad_level():
    with pytest.raises(ValueError, match="log_level='LOUD'"):
        get_logger("x", log_level="loud")
