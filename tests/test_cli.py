import os
import subprocess
import sys

import pytest


def test_env_reports_versions_and_build():
    out = subprocess.run([sys.executable, "-m", "mixprec", "env"], capture_output=True, text=True, check=True)
    assert "built against torch" in out.stdout and "CUDA kernels built" in out.stdout


def test_version_prints_the_version_and_build():
    import mixprec

    out = subprocess.run([sys.executable, "-m", "mixprec", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"mixprec {mixprec.__version__} (built against torch ")


_MYTRAIN = """
import torch
from torch import nn

def make_model():
    torch.manual_seed(0)
    return nn.Linear(16, 4)

def good_batch(step):
    return torch.randn(8, 16), torch.randn(8, 4)

def wrong_targets(step):          # (8, 3) targets for a (8, 4) output: MSE would broadcast
    return torch.randn(8, 16), torch.randn(8, 3)

def wrong_inputs(step):           # 12 features for a Linear(16, ...)
    return torch.randn(8, 12), torch.randn(8, 4)

def not_a_pair(step):
    return torch.randn(8, 16)
"""


@pytest.mark.parametrize("batch, match", [
    ("wrong_targets", r"output has shape \(8, 4\) but the targets of wrong_targets\(0\) have shape \(8, 3\)"),
    ("wrong_inputs", r"rejected the inputs of wrong_inputs\(0\) \(shape \(8, 12\)"),
    ("not_a_pair", r"not_a_pair\(0\) returned Tensor; make_batch \(--batch\) must return a tuple"),
])
def test_parity_names_make_batch_for_a_wrong_batch(tmp_path, batch, match):
    """Run from the folder holding mytrain.py with no PYTHONPATH (the quickstart's way):
    the module is found, and a wrong batch is one error naming make_batch, before any rank."""
    import re

    (tmp_path / "mytrain.py").write_text(_MYTRAIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "mixprec", "parity", "--model", "mytrain:make_model",
                          "--batch", f"mytrain:{batch}", "--backends", "single", "--steps", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(match, out.stderr), out.stderr
    assert out.stderr.count("mixprec parity: error:") == 1 and "Traceback" not in out.stderr


def test_parity_missing_module_names_the_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "mixprec", "parity", "--model", "nosuchmod:make_model",
                          "--batch", "nosuchmod:make_batch"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert f"no module named 'nosuchmod' in the current folder ({tmp_path})" in out.stderr, out.stderr
