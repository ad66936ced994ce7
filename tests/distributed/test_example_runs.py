"""The examples train under `mixprec launch`: the main one with 2 processes on zero2 in bf16
(a config file) and on 2 "nodes" over loopback (ddp); digits_cnn, char_gpt and denoiser with 2
processes on zero2 in bf16."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import launch_two_nodes

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_transformer.py")
ARGS = ["--steps", "40", "--batch", "16", "--cpu"]


def _assert_trained(output: str, backend: str = "ddp", precision: str = "bf16") -> None:
    m = re.search(rf"done: loss ([\d.]+) -> ([\d.]+) .*\({precision}, backend {backend}, 2 process\(es\)", output)
    assert m, output
    assert float(m.group(2)) < float(m.group(1))


def test_example_trains_with_two_processes_on_zero2_bf16_from_a_config_file(tmp_path):
    config = tmp_path / "mixprec.yaml"
    config.write_text("backend: zero2\nmixed_precision: bf16\ngradient_accumulation_steps: 2\n")
    out = subprocess.run([sys.executable, "-m", "mixprec", "launch", "--config-file", str(config),
                          "--nproc-per-node", "2", EXAMPLE, *ARGS],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_trained(out.stdout, backend="zero2")
    assert out.stdout.count("done: loss") == 1  # printed by the main process only


def test_example_trains_on_two_nodes_over_loopback():
    codes, outs = launch_two_nodes([EXAMPLE, *ARGS], timeout=300)
    assert codes == [0, 0], [o[1][-2000:] for o in outs]
    _assert_trained(outs[0][0])


# ----------------------------------------------------------------------------- new examples
# tests/ is on sys.path (conftest.py); the quick settings are shared with the one-process runs.
from test_examples import QUICK, assert_final, run_example  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_new_example_trains_on_zero2_bf16_with_two_processes(script, tmp_path):
    # Only the config changes between backends: the same script ran on `single` in test_examples.
    config = tmp_path / "zero2.yaml"
    config.write_text("backend: zero2\nmixed_precision: bf16\n")
    out = run_example(script, "--config", str(config), "--output-dir", str(tmp_path / "ckpt"),
                      launcher=("-m", "mixprec", "launch", "--nproc-per-node", "2"))
    assert_final(out, "zero2", 2, "bf16")
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").iterdir())
    # rank-aware logging and the progress bar: the main process only
    assert "[rank 0/2] INFO" in out.stderr and "[rank 1/2]" not in out.stderr
    steps = QUICK[script][1]
    assert out.stderr.count(f"| {steps}/{steps} [") >= 1


@pytest.mark.slow
def test_tp_llama_example_trains_with_tensor_parallelism(tmp_path):
    """examples/tp_llama.py on 2 processes (TP=2, bf16): it learns the task, and the
    16-bit export reloads into a plain model with the same accuracy."""
    pytest.importorskip("transformers")
    out = run_example("tp_llama.py", "--mixed-precision", "bf16", "--output-dir", str(tmp_path / "out"),
                      launcher=("-m", "mixprec", "launch", "--nproc-per-node", "2"))
    assert_final(out, "ddp", 2, "bf16")
    assert "tensor_parallel.size=2" in out.stdout and "mesh dp=1 x tp=2" in out.stdout, out.stdout
    acc = float(out.stdout.split("next-token accuracy ")[-1].split(",")[0])
    reloaded = float(out.stdout.split("(bfloat16): next-token accuracy ")[1].split()[0])
    assert acc >= 0.9 and abs(reloaded - acc) <= 0.05, out.stdout


@pytest.mark.slow
def test_long_context_example_fits_the_cap_with_sequence_parallelism_only(tmp_path):
    """examples/long_context.py (8192 tokens): one process goes over the per-rank step-memory
    cap and says so (exit 3); SP=2 on 2 processes fits it, with the same (exact) losses."""
    pytest.importorskip("transformers")
    script = str(Path(EXAMPLE).parent / "long_context.py")
    one = subprocess.run([sys.executable, script, "--sp", "1", "--steps", "2"], capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 3 and "over the cap: a sequence of 8192 tokens does not fit 512 MiB" in one.stdout, \
        (one.returncode, one.stdout[-2000:], one.stderr[-2000:])
    two = run_example("long_context.py", launcher=("-m", "mixprec", "launch", "--nproc-per-node", "2"))
    assert "mesh dp=1 x sp=2" in two.stdout and "over the cap" not in two.stdout, two.stdout
    losses = [[float(v) for v in line.split("final: loss ")[1].split(",")[0].split(" -> ")]
              for line in (one.stdout, two.stdout)]
    # Printed to 4 decimals ("first -> last"): one unit of the last printed digit (two losses a
    # rounding apart can print either side of a digit's boundary).
    assert len(losses[0]) == len(losses[1]) == 2, losses
    assert all(abs(a - b) <= 1e-4 + 1e-9 for a, b in zip(*losses)), losses
