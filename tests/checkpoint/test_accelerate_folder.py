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


@pytest.fixture(autouse=True)
def _release_accelerators():
    """A zero2 Accelerator in this process makes a one-process group: end it after each
    test, or a later test in the same worker finds the default group taken."""
    yield
    from mixprec import registry

    for acc in registry.running():
        acc.end_training()


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    """(folder written by Accelerate's save_state, Accelerate's own records of the runs)."""
    where = tmp_path_factory.mktemp("accelerate_folder")
    folder = where / "step_5"
    out = subprocess.run([sys.executable, str(RUN), str(folder), str(where / "theirs")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return folder, torch.load(where / "theirs.rank0.pt", weights_only=False)


def test_load_state_reads_an_accelerate_folder_and_continues_as_accelerate_resume(accelerate_run):
    folder, theirs = accelerate_run
    assert sorted(p.name for p in folder.iterdir()) == [
        "custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    ours = R.resume("mixprec", str(folder))
    R.assert_same_state(ours["after_load"], theirs["after_load"])
    R.assert_continues_as_accelerate(folder, [ours], [theirs])
    # Accelerate's resume reads its uninterrupted run's batches (the loader's seeded
    # generator) but its numbers differ from that run's (a checkpoint holds no gradients of
    # the open accumulation window): hence the comparison with the resume, above.
    assert [x["index"] for x in theirs["records"]] == [x["index"] for x in theirs["full"][R.SAVE_AT:]]


def test_the_state_lands_in_the_fp32_masters(accelerate_run):
    """Into a run with bf16 parameters and fp32 masters: the masters take Accelerate's fp32
    weights exactly, the parameters their bf16 rounding, and the AdamW state (keyed by the
    masters) Accelerate's, exactly."""
    folder, theirs = accelerate_run
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, mixed_precision="bf16", param_dtype=torch.bfloat16)
    assert acc.engine.precision.master_of  # this run keeps masters
    acc.load_state(str(folder))
    saved = theirs["after_load"]
    masters = acc.get_state_dict(model)
    params = acc.unwrap_model(model).state_dict()
    for k, w in saved["weights"].items():
        assert masters[k].dtype == torch.float32 and torch.equal(masters[k], w), k
        assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], w.to(torch.bfloat16)), k
    state = opt.state_dict()["state"]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    for i, entries in saved["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(state[i][key], value), (i, key)
    assert opt.param_groups[0]["lr"] == saved["optimizer"]["param_groups"][0]["lr"]


def test_bf16_tensors_widen_exactly_into_the_fp32_masters(accelerate_run, tmp_path):
    """A bf16 model trained under Accelerate saves bf16 weights and AdamW state; a run with
    fp32 masters takes them widened (exact), any other dtype change is refused."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(accelerate_run[0], folder)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    sd = torch.load(folder / "optimizer.bin", weights_only=True)
    for entries in sd["state"].values():
        entries.update({k: v.to(torch.bfloat16) for k, v in entries.items() if k != "step"})
    torch.save(sd, folder / "optimizer.bin")
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, mixed_precision="bf16", param_dtype=torch.bfloat16)
    acc.load_state(str(folder))
    masters = acc.get_state_dict(model)
    assert all(masters[k].dtype == torch.float32 and torch.equal(masters[k], w.float()) for k, w in weights.items())
    state = opt.state_dict()["state"]
    assert all(torch.equal(state[i][k], v.float()) for i, e in sd["state"].items() for k, v in e.items())
    # fp32 into a run whose parameters are bf16 without masters would round: refused.
    acc, model, opt, before = _fresh(mixed_precision="bf16-pure")
    refusal = "mis-typed keys .*model/0.weight: checkpoint dtype torch.float32 vs model torch.bfloat16"
    with pytest.raises(mixprec_error(), match=refusal):
        acc.load_state(str(accelerate_run[0]))
    _nothing_loaded(acc, model, opt, before)


def test_weights_alone_load_on_a_sharded_backend(accelerate_run, tmp_path):
    """A folder saved before the first optimizer step (no per-parameter state) loads on
    zero2: the weights, and the hyper-parameters."""
    folder = tmp_path / "ckpt"
    shutil.copytree(accelerate_run[0], folder)
    sd = torch.load(folder / "optimizer.bin", weights_only=True)
    torch.save({"state": {}, "param_groups": sd["param_groups"]}, folder / "optimizer.bin")
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, "zero2")
    acc.load_state(str(folder))
    masters = acc.get_state_dict(model)
    theirs = accelerate_run[1]["after_load"]["weights"]
    assert all(torch.equal(masters[k], w) for k, w in theirs.items())
    assert opt.param_groups[0]["lr"] == sd["param_groups"][0]["lr"] != R.LR


@pytest.mark.parametrize("mixed_precision", ["fp16", "no"])
def test_scaler_pt_loads_into_fp16_and_is_refused_without_loss_scaling(accelerate_run, tmp_path, mixed_precision):
    """scaler.pt is torch.amp.GradScaler.state_dict() (what Accelerate saves on a GPU)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(accelerate_run[0], folder)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(2)
    torch.save(scaler.state_dict(), folder / "scaler.pt")
    if mixed_precision == "no":
        acc, model, opt, before = _fresh()
        with pytest.raises(mixprec_error(), match="holds loss-scaler state but mixed_precision='no' has no loss "
                                                  "scaling; load it with mixed_precision='fp16'"):
            acc.load_state(str(folder))
        _nothing_loaded(acc, model, opt, before)
        return
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, mixed_precision="fp16")
    acc.load_state(str(folder))
    state = acc.engine.scaler_state_dict()
    assert state["scale"] == 1024.0 and state["_growth_tracker"] == 2


def _fresh(backend="single", **options):
    acc, model, opt, loader, sched, seen = R.build("mixprec", 123, backend, **options)
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


_TWO_MODELS = """
import sys, torch
from accelerate import Accelerator

def models():
    m1 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    m1[2].weight = m1[0].weight  # tied: safetensors keeps one of the two names
    return m1, torch.nn.Linear(4, 2)

if __name__ == "__main__":
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    m1, m2 = models()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.SGD(m2.parameters(), lr=1e-2, momentum=0.9)
    m1, m2, o1, o2 = acc.prepare(m1, m2, o1, o2)
    for _ in range(2):
        acc.backward(m2(m1(torch.randn(5, 4))).pow(2).mean()); o1.step(); o2.step(); o1.zero_grad(); o2.zero_grad()
    acc.save_state(sys.argv[1])
    torch.save([m1.state_dict(), m2.state_dict(), o1.state_dict(), o2.state_dict()], sys.argv[1] + ".ref")
"""


def test_two_models_two_optimizers_and_a_tied_weight(tmp_path):
    """model_1.safetensors and optimizer_1.bin go to the second model and optimizer (an SGD
    with momentum beside an AdamW), each state exactly Accelerate's; the first model's tied
    weight, saved under one of its names, fills both."""
    from safetensors import safe_open

    from mixprec import Accelerator

    folder = tmp_path / "two"
    out = subprocess.run([sys.executable, "-c", _TWO_MODELS, str(folder)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == [
        "model.safetensors", "model_1.safetensors", "optimizer.bin", "optimizer_1.bin", "random_states_0.pkl"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert len({"0.weight", "2.weight"} & set(f.keys())) == 1  # the tied weight, once
    namespace = {"__name__": "two_models"}
    exec(_TWO_MODELS, namespace)  # the same models (not __main__: nothing runs)
    torch.manual_seed(5)
    acc = Accelerator(cpu=True, log_policy=False)
    m1, m2 = namespace["models"]()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.SGD(m2.parameters(), lr=1e-2, momentum=0.9)
    m1, m2, o1, o2 = acc.prepare(m1, m2, o1, o2)
    acc.load_state(str(folder))
    ref = torch.load(str(folder) + ".ref", weights_only=True)
    for saved, model in zip(ref[:2], (m1, m2)):
        got = acc.unwrap_model(model).state_dict()
        assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in saved)
    unwrapped = acc.unwrap_model(m1)
    assert unwrapped[2].weight is unwrapped[0].weight  # still tied
    for saved, opt, count in zip(ref[2:], (o1, o2), (3, 2)):
        got = opt.state_dict()
        assert saved["state"].keys() == got["state"].keys() == set(range(count))
        assert all(torch.equal(v, got["state"][i][k]) for i, e in saved["state"].items() for k, v in e.items())
        assert saved["param_groups"] == got["param_groups"]
