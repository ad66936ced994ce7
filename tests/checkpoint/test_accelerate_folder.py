"""Issue #36 point 5: ``load_state`` reads a folder written by Accelerate's ``save_state``
(src/mixprec/checkpoint/accelerate_folder.py), and refuses, naming the file, what it cannot
carry.

The folder is written by the installed Accelerate (tests/_accelerate_folder_run.py, in a
subprocess: an uninterrupted run saving mid accumulation window, then Accelerate's own
resume from the folder). mixprec resumes from the same folder in this process with the
same idiom (``load_state`` + ``skip_first_batches``). Right after ``load_state`` every
restored state (weights, AdamW state and hyper-parameters, scheduler, torch / python /
numpy RNG, accumulation counter, registered object) equals Accelerate's bit for bit; the
continued run reads the same batches, draws the same random numbers, steps at the same
micro-batches with the same learning rates. Its losses and weights are held to the float64
rule: a float64 replay of the continued run (plain torch, from the folder's files) is the
reference, and mixprec must be no farther from it than twice Accelerate's (a plain fp32
torch run) distance, and within that distance of Accelerate's numbers. (mixprec's fused
AdamW kernel and torch's for-loop AdamW may round an element's update differently: an ulp.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import _accelerate_folder_run as R  # noqa: E402 (tests/ is on sys.path: tests/checkpoint/conftest.py)

RUN = Path(R.__file__)


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    """(folder written by Accelerate's save_state, Accelerate's own records of the runs)."""
    where = tmp_path_factory.mktemp("accelerate_folder")
    folder = where / "step_5"
    out = subprocess.run([sys.executable, str(RUN), str(folder), str(where / "theirs")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return folder, torch.load(where / "theirs.rank0.pt", weights_only=False)


def assert_same_state(ours: dict, theirs: dict, where: str = "") -> None:
    """Two snapshots of R.snapshot(): equal to the bit."""
    assert ours["weights"].keys() == theirs["weights"].keys(), where
    for k in theirs["weights"]:
        assert torch.equal(ours["weights"][k], theirs["weights"][k]), (where, k)
    o, t = ours["optimizer"], theirs["optimizer"]
    assert o["param_groups"] == t["param_groups"], where
    assert o["state"].keys() == t["state"].keys() and len(t["state"]) == 4, where
    for i, entries in t["state"].items():
        assert o["state"][i].keys() == entries.keys(), (where, i)
        for key, value in entries.items():
            assert torch.equal(o["state"][i][key], value), (where, i, key)
    assert ours["scheduler"] == theirs["scheduler"], where
    assert torch.equal(ours["torch_rng"], theirs["torch_rng"]), where
    assert ours["python_rng"] == theirs["python_rng"], where
    assert ours["numpy_rng"] == theirs["numpy_rng"], where
    assert ours["step"] == theirs["step"] == R.SAVE_AT, where
    assert ours["seen"] == theirs["seen"] == R.SAVE_AT, where


def assert_continues_as_accelerate(folder, ours: list, theirs: list) -> None:
    """``ours``/``theirs``: per rank, the results of R.resume() under mixprec / Accelerate."""
    for r, (o, t) in enumerate(zip(ours, theirs)):
        # The same batches, random draws, accumulation boundaries and learning rates.
        for key in ("index", "a", "b", "sync", "lr", "seen"):
            assert [x[key] for x in o["records"]] == [x[key] for x in t["records"]], (r, key)
        assert all(torch.equal(x["noise"], y["noise"]) for x, y in zip(o["records"], t["records"])), r
    per_rank = R.N // (2 * len(ours))
    assert len(theirs[0]["records"]) == R.EPOCHS * per_rank - R.SAVE_AT
    reference = R.replay_float64(str(folder), [t["records"] for t in theirs])

    def loss_error(run, r):
        return max(abs(x["loss"] - y) for x, y in zip(run["records"], reference["losses"][r]))

    def weight_error(a, b):
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in reference["weights"])

    for r, (o, t) in enumerate(zip(ours, theirs)):
        theirs_loss, ours_loss = loss_error(t, r), loss_error(o, r)
        # The replay follows Accelerate's run (else the reference would be meaningless) ...
        assert 0 < theirs_loss < 1e-5, theirs_loss
        # ... and mixprec is no farther from float64 than Accelerate's fp32 run (x2: rounding).
        assert ours_loss <= 2 * theirs_loss, (r, ours_loss, theirs_loss)
        assert max(abs(x["loss"] - y["loss"]) for x, y in zip(o["records"], t["records"])) <= theirs_loss, r
        theirs_w, ours_w = weight_error(t["weights"], reference["weights"]), weight_error(o["weights"], reference["weights"])
        assert 0 < theirs_w < 1e-5 and ours_w <= 2 * theirs_w, (r, ours_w, theirs_w)
        assert weight_error(o["weights"], t["weights"]) <= theirs_w, r


def test_load_state_reads_an_accelerate_folder_and_continues_as_accelerate_resume(accelerate_run):
    folder, theirs = accelerate_run
    assert sorted(p.name for p in folder.iterdir()) == [
        "custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    ours = R.resume("mixprec", str(folder))
    assert_same_state(ours["after_load"], theirs["after_load"])
    assert_continues_as_accelerate(folder, [ours], [theirs])
    # Accelerate's resume is not its uninterrupted run (the saved window's gradients are
    # not in a checkpoint): the comparison above is with the resume, which mixprec follows.
    assert [x["index"] for x in theirs["records"]] == [x["index"] for x in theirs["full"][R.SAVE_AT:]]


def _fresh(backend="single"):
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, backend)
    before = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return acc, model, opt, before


def _nothing_loaded(acc, model, opt, before) -> None:
    after = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not opt.state_dict()["state"] and opt.param_groups[0]["lr"] == R.LR


def _rename_a_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["zzz.weight"] = sd.pop("0.weight")
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


# case -> (how the folder is changed, what the error must say)
CASES = {
    "missing optimizer": (lambda f: (f / "optimizer.bin").unlink(),
                          ["holds 0 optimizer state(s) (no optimizer.bin) but this run prepared/registered 1"]),
    "other process count": (lambda f: shutil.copy(f / "random_states_0.pkl", f / "random_states_1.pkl"),
                            ["holds the RNG states of 2 process(es)", "this run has 1", "Resume with 2 process(es)"]),
    "stateful dataloader": (lambda f: torch.save({"_num_yielded": 3}, f / "dl_state_dict.bin"),
                            ["dl_state_dict.bin holds the state of Accelerate's StatefulDataLoader",
                             "move dl_state_dict.bin out of the folder", "skip_first_batches(loader, n)"]),
    "pickled class": (lambda f: torch.save({"count": R.Box(5)}, f / "custom_checkpoint_0.pkl"),
                      ["custom_checkpoint_0.pkl pickles _accelerate_folder_run.Box",
                       "torch.serialization.add_safe_globals([Box])", "unpickling runs code"]),
    "fsdp layout": (lambda f: (f / "pytorch_model_fsdp_0").mkdir(),
                    ["was written with Accelerate's FSDP", "accelerate merge-weights"]),
    "renamed weight": (_rename_a_weight, ["missing keys ['model/0.weight']", "unexpected keys ['model/zzz.weight']"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refuses_what_it_cannot_carry_and_loads_nothing(accelerate_run, tmp_path, case):
    folder = tmp_path / "ckpt"
    shutil.copytree(accelerate_run[0], folder)
    change, expected = CASES[case]
    change(folder)
    acc, model, opt, before = _fresh()
    with pytest.raises(mixprec_error()) as e:
        acc.load_state(str(folder))
    message = str(e.value)
    assert all(x in message for x in expected), message
    assert message.startswith("load_state() loaded nothing") and "interrupted" not in message, message
    _nothing_loaded(acc, model, opt, before)


def mixprec_error():
    from mixprec.checkpoint import CheckpointError

    return CheckpointError


def test_a_pickled_class_loads_once_allowed(accelerate_run, tmp_path):
    """The way out the refusal names: allow the class (for a trusted folder)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(accelerate_run[0], folder)
    torch.save({"count": R.Box(5)}, folder / "custom_checkpoint_0.pkl")
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123)
    with torch.serialization.safe_globals([R.Box]):
        acc.load_state(str(folder))
    assert isinstance(seen.count, R.Box) and seen.count.value == 5
    assert opt.state_dict()["state"][0]["step"] == 2  # two optimizer steps in the 5 saved micro-batches


def test_a_sharded_backend_refuses_positional_optimizer_state(accelerate_run):
    acc, model, opt, before = _fresh("zero2")
    with pytest.raises(mixprec_error()) as e:
        acc.load_state(str(accelerate_run[0]))
    message = str(e.value)
    assert "optimizer.bin keys each parameter's optimizer state by its position" in message, message
    assert "backend='zero2'" in message and "Load this folder with backend='ddp'" in message, message
    after = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
