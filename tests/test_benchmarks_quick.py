"""`python benchmarks/run_all.py --quick --out DIR` (a smoke run at tiny sizes) writes the
report, the raw results and the plots, with every comparison present. Timings are never
asserted; the byte counts and memory, which do not depend on load, are."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _installed(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, (out / "RESULTS.md").read_text(), json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_quick_run_writes_report_results_and_plots(quick_run):
    out, md, _ = quick_run
    assert md.startswith("# mixprec benchmark results (QUICK SMOKE RUN")
    for png in ("step_time.png", "memory.png", "loss_curves.png", "scaling.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
        assert f"`{png}`" in md
    for fact in ("| CPU |", "| versions | torch ", "load average (1/5/15 min) before", "load average after",
                 "oversubscribed", "## Commands"):
        assert fact in md, fact


@pytest.mark.slow
def test_quick_run_has_every_comparison_row(quick_run):
    _, md, res = quick_run
    targets = md.split("## Targets")[1].split("\n## ")[0]
    rows = [line for line in targets.splitlines() if line.startswith("| ") and not line.startswith("| comparison")]
    expected = ["single: mixprec / plain PyTorch loop", "ddp N=2: mixprec_ddp / torch DDP",
                "mixprec fsdp / torch torch_fsdp2 ", "mixprec fsdp_keep / torch torch_fsdp2_keep",
                "fused step speed-up over plain PyTorch"]
    for world in (2, 4):
        for stage in ("zero1", "zero2", "zero3"):
            expected.append(f"memory N={world}: {stage} persistent bytes/rank / ZeRO formula")
            expected.append(f"collectives N={world}: {stage} elements/step / theory")
    for name in expected:
        matching = [r for r in rows if name in r]
        assert matching, f"no target row for {name!r}"
        assert all(("| met |" in r) or ("| **missed** |" in r) for r in matching), matching
    # The comparison tables: every contender of every comparison, or the reason it did not run.
    sections = {
        "## Single process": ["plain", "plain_fused", "mixprec"] + (["accelerate"] if _installed("accelerate") else []),
        "## DDP, N=2": ["torch_ddp", "torch_ddp_fused_adamw", "mixprec_ddp"]
                       + (["accelerate_ddp"] if _installed("accelerate") else []),
        "### N=1": ["mixprec_single", "torch_fsdp2", "torch_ddp"],
        "### N=2": ["mixprec_ddp", "zero1", "zero2", "zero2_rs", "zero3", "fsdp", "torch_fsdp2", "torch_ddp"],
        "### N=4": ["mixprec_ddp", "zero1", "zero2", "zero2_rs", "zero3", "fsdp", "torch_fsdp2", "torch_ddp"],
        "## mixprec FSDP vs torch fully_shard": ["fsdp", "fsdp_keep", "torch_fsdp2", "torch_fsdp2_keep"],
    }
    for stage in ("1", "2", "3"):
        for section in ("### N=1", "### N=2"):
            sections[section].append(f"deepspeed_zero{stage}")
    for header, contenders in sections.items():
        body = md.split(header)[1].split("\n#")[0]
        for name in contenders:
            if name.startswith("deepspeed") and not _installed("deepspeed"):
                assert f"`{name}` did not run: deepspeed is not installed" in body, (header, name)
            else:
                assert f"| {name} |" in body, (header, name)
    if not _installed("accelerate"):
        assert "Accelerate's DDP did not run here: accelerate is not installed" in md
    assert "## How cost grows" in md and "Model size at N=2" in md
    for k in ("## Persistent memory per rank", "## Collective payload per step", "## Fused kernels"):
        assert k in md


@pytest.mark.slow
def test_quick_run_memory_and_bytes_match_theory(quick_run):
    """Not timings: persistent bytes and collective elements are exact functions of P and N."""
    _, _, res = quick_run
    for world in ("2", "4"):
        main = res["zero"][world][0]
        assert set(main["memory"]) == set(main["comm"]) == {"zero1", "zero2", "zero3"}
        for name, m in main["memory"].items():
            assert abs(m["ratio"] - 1) <= 0.10, (world, name, m)
        for name, c in main["comm"].items():
            # Bucket padding adds fewer than N elements per bucket and per collective.
            assert c["theory_elements"] <= c["elements"] <= c["theory_elements"] * 1.01, (world, name, c)
