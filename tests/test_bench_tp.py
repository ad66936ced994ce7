"""`python benchmarks/bench_tp.py --quick --out FILE` (tiny Llama, contenders of one world
size sharing a process group) writes every contender with finite positive numbers, and its
1/TP verdicts follow from the tensors it counted. Timings are never asserted.

`make test` checks the report of a recorded quick run (tests/data/bench_tp_quick.json and
its printed table, recorded with the command above); the live run is a `bench` test
(`make test-bench`, CI's benchmark step), checked by the same function."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).with_name("data") / "bench_tp_quick"


def check_report(res: dict, stdout: str) -> None:
    """Every contender present (or a skipped peer saying why), numbers finite and positive,
    the 1/TP verdicts recomputed from the per-rank, per-name bytes counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tp import contenders

    rows, skipped = res["contenders"], res["skipped"]

    for spec in contenders():
        name = spec["name"]
        if spec["kind"] == "deepspeed" and name in skipped:  # a peer that cannot run here says why
            assert skipped[name].strip(), name
            assert name in stdout, name
            continue
        assert name in rows, (name, sorted(rows), skipped)
        r = rows[name]
        for k in ("baseline", "resident", "peak", "resident_growth", "peak_growth", "local_params",
                  "local_param_bytes", "full_params"):
            assert math.isfinite(r[k]) and r[k] > 0, (name, k, r[k])
        assert all(math.isfinite(t) and t > 0 for t in r["step_time"]["samples"]), name
        assert r["peak"] >= r["resident"] > r["baseline"], name
        if spec["kind"] == "mixprec":
            assert r["local_params"] * spec["tp"] >= r["full_params"] * 0.99, name  # split, not lost
            assert f"| {name} |" in stdout, name

    # The verdicts follow from the counted tensors: recompute from the per-rank, per-name bytes.
    assert {(v["backend"], v["dp"]) for v in res["split"]} == {(b, d) for b in ("ddp", "zero1", "zero2")
                                                                for d in (1, 2)}
    for v in res["split"]:
        names = set(rows[v["tp2"]]["split_names"])
        assert names and v["unmapped_optimizer"] == 0, v

        def held(row, parts):
            return max(sum(b for p in parts for n, b in st[p].items() if n in names)
                       for st in rows[row]["state_per_rank"])

        ok = True
        for key, parts in (("params", ["params"]), ("grads", ["grads"]),
                           ("optimizer_with_masters", ["optimizer", "masters"])):
            a, c = held(v["tp1"], parts), held(v["tp2"], parts)
            assert a > 0 and c > 0, (v["backend"], v["dp"], key)
            assert math.isclose(c / a, v["ratios"][key]), (v["backend"], v["dp"], key)
            ok = ok and abs(c / a * 2 - 1) <= 0.10
        assert v["verdict"] == ("met" if ok else "missed"), v
        assert f"| {v['backend']} | {v['dp']} |" in stdout


def test_recorded_quick_run_report():
    check_report(json.loads((RECORDED / "tp.json").read_text()), (RECORDED / "stdout.txt").read_text())


@pytest.mark.slow
@pytest.mark.bench
def test_bench_tp_quick_has_every_contender_and_verdicts_follow_the_counted_bytes(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tp.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    check_report(json.loads(out.read_text()), proc.stdout)
