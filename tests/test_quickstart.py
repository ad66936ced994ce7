"""docs/quickstart.md's command blocks run as written: the two-process bf16 ZeRO-3 block
(issue 8, point 5) and the parity block with its `mytrain.py` (issue 29, point 7).

The block's set-up lines (`make demo`, `source .venv/bin/activate`) are what got this test
suite running; the rest is executed verbatim, in a scratch folder, with this interpreter's
`bin/` first on PATH (where the `mixprec` command is installed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- quickstart:zero3"
SETUP = ("make demo", "source .venv/bin/activate")


def _block(marker: str, lang: str) -> str:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    start = text.index(marker)
    block = re.search(rf"```{lang}\n(.*?)```", text[start:], re.S)
    assert block is not None, f"the {marker} marker must be followed by a ```{lang} block"
    return block.group(1)


def quickstart_commands(marker: str = MARKER) -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in _block(marker, "bash").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(SETUP)]


def _run_as_written(cmds: list[str], cwd: Path) -> list[str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("MIXPREC_CONFIG_FILE", None)
    outputs = []
    for cmd in cmds:
        proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        outputs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{cmd!r} failed:\n{proc.stdout}\n{proc.stderr}"
    return outputs


def test_quickstart_block_is_what_the_readme_points_to():
    readme = (ROOT / "README.md").read_text()
    assert "docs/quickstart.md" in readme
    cmds = quickstart_commands()
    assert any(c.startswith("mixprec launch") and "--nproc-per-node 2" in c for c in cmds)
    assert any("--backend zero3" in c and "--mixed-precision bf16" in c for c in cmds)


@pytest.mark.slow
@pytest.mark.e2e  # the documented commands end to end: `make test-e2e` (CI)
def test_quickstart_zero3_two_processes_bf16(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    outputs = _run_as_written(quickstart_commands(), tmp_path)
    explained, launched = outputs[-2], outputs[-1]
    assert "zero3" in explained and "bf16" in explained
    assert "backend zero3" in launched and "2 process" in launched, launched


@pytest.mark.slow
@pytest.mark.e2e
def test_quickstart_parity_block_with_its_mytrain(tmp_path):
    """`mixprec parity --model mytrain:make_model ...` from the folder holding mytrain.py
    (it raised ModuleNotFoundError: a console script does not put the current folder on
    sys.path), and the built-in demo line before it."""
    (tmp_path / "mytrain.py").write_text(_block("<!-- quickstart:mytrain.py", "python"))
    cmds = quickstart_commands("<!-- quickstart:parity")
    assert any("mytrain:make_model" in c and "mytrain:make_batch" in c for c in cmds)
    demo, mine = _run_as_written(cmds, tmp_path)
    for out in (demo, mine):
        assert "single" in out and "ddp" in out and "PASS" in out and "FAIL" not in out, out
