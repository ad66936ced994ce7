"""docs/quickstart.md's two-process bf16 ZeRO-3 block runs as written (issue 8, point 5).

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


def quickstart_commands() -> list[str]:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    start = text.index(MARKER)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block is not None, "the quickstart:zero3 marker must be followed by a ```bash block"
    lines = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(SETUP)]


def test_quickstart_block_is_what_the_readme_points_to():
    readme = (ROOT / "README.md").read_text()
    assert "docs/quickstart.md" in readme
    cmds = quickstart_commands()
    assert any(c.startswith("mixprec launch") and "--nproc-per-node 2" in c for c in cmds)
    assert any("--backend zero3" in c and "--mixed-precision bf16" in c for c in cmds)


@pytest.mark.slow
def test_quickstart_zero3_two_processes_bf16(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("MIXPREC_CONFIG_FILE", None)
    outputs = []
    for cmd in quickstart_commands():
        proc = subprocess.run(
            cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        outputs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{cmd!r} failed:\n{proc.stdout}\n{proc.stderr}"
    explained, launched = outputs[-2], outputs[-1]
    assert "zero3" in explained and "bf16" in explained
    assert "backend zero3" in launched and "2 process" in launched, launched
