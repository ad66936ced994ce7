"""Parameters outside forward on every backend (issue #24 items 1-3), 2 processes over Gloo.

One process pair per backend runs every check (starting processes is what costs): the
zero3/fsdp guard ([Note: guarded sharded parameters] in src/mixprec/engines/gathered.py),
the gathering context ([Note: the gathering context]) and the common uses: a weight-norm
log, an EMA model updated every step, re-initialising a layer with ``modifier_rank=0`` and
training on, ``print(model)``, ``model.state_dict()``, pickling and deep copies.

The reference is plain PyTorch in one process: the same model, the same AdamW, the loss
averaged over both ranks' batches (what the data-parallel backends compute), the same
edit and the same EMA. mixed_precision="no": the backends match DDP bitwise at N=2
(tests/distributed/test_fsdp_engine.py), and DDP matches one process on the concatenated
batch up to the order of the fp32 gradient sums; asserted: 1e-5 relative per tensor's
largest value, as that file's four-process bound.
"""

import pytest

from harness import run_distributed

BACKENDS = {
    "single": None,
    "ddp": None,
    "zero1": None,
    "zero2": None,
    "zero3": {"units": "size:100"},  # each Linear a unit, the LayerNorm in the root
    "fsdp": {"units": ["Linear"]},
}
SHARDS_PARAMS = ("zero3", "fsdp")


def _batches(step, world):
    import torch

    g = torch.Generator().manual_seed(500 + step)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(world)]


def _checks(state, backend, opts):
    import copy
    import io

    import torch
    import torch.distributed as dist
    from torch import nn

    import mixprec
    from _helpers import make_mlp
    from mixprec import Accelerator, UnshardedParameterError

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    acc = Accelerator(mixed_precision="no", backend=backend, cpu=True, log_policy=False,
                      engine_options=opts)
    model = make_mlp(seed=0)  # Linear(16,64), GELU, LayerNorm(64), Linear(64,4)
    ref = copy.deepcopy(model)
    param_ids = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    prepared, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["same_objects"] = (prepared is model and [id(p) for p in model.parameters()] == param_ids
                           and list(model.state_dict(keep_vars=True)) == keys)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ema = ref_ema = None

    def step(i):
        batches = _batches(i, world)
        x, y = batches[rank]
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(ref(xb), yb) for xb, yb in batches) / len(batches)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def update_ema():
        with torch.no_grad():
            with acc.gathered_parameters(model):
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
            for e, p in zip(ref_ema.parameters(), ref.parameters()):
                e.lerp_(p, 0.1)

    step(0)
    # --- the segfault case: a read outside any gathered scope
    try:
        value = model[0].weight.norm().item()
        out["outside"] = ("value", abs(value - ref[0].weight.norm().item()) / ref[0].weight.norm().item())
    except UnshardedParameterError as e:
        out["outside"] = ("error", str(e), e.params, e.units)
    # metadata works everywhere, without gathering
    w = model[0].weight
    out["meta"] = (tuple(w.shape), w.dtype, w.requires_grad, w.numel(), isinstance(w, nn.Parameter),
                   [n for n, _ in model.named_parameters()] == list(dict(ref.named_parameters())))
    out["print"] = str(model)
    out["repr"] = repr(model[0].weight)
    model.zero_grad()
    opt.zero_grad()
    sd = model.state_dict()  # keys and shapes always; values read inside the context (zero3/fsdp)
    out["state_dict_keys"] = list(sd) == list(ref.state_dict()) and all(
        sd[k].shape == v.shape for k, v in ref.state_dict().items())
    try:
        out["state_dict"] = ("value", bool(sd["0.weight"].sub(ref[0].weight.detach()).abs().max() < 1e-5))
    except UnshardedParameterError as e:
        out["state_dict"] = ("error", str(e))
    try:
        torch.save(model, io.BytesIO())
        out["pickle_outside"] = "ok"
    except UnshardedParameterError as e:
        out["pickle_outside"] = str(e)

    # --- the context: read (weight norm log, state_dict, pickle, deep copy)
    full = acc.get_state_dict(model)
    with acc.gathered_parameters(model):
        norm = model[0].weight.norm().item()
        out["norm"] = abs(norm - ref[0].weight.norm().item()) / ref[0].weight.norm().item()
        out["norm_full"] = norm == full["0.weight"].norm().item()
        inside = model.state_dict()
        out["state_dict_inside"] = all(inside[k].equal(full[k]) for k in full)
        buf = io.BytesIO()
        torch.save(model, buf)
        ema = copy.deepcopy(model)  # the EMA: a full copy of its own
        out["repr_inside"] = repr(model[0].bias).startswith("Parameter containing")
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out["pickle"] = (type(loaded) is nn.Sequential and type(loaded[0].weight) is nn.Parameter
                     and all(loaded.state_dict()[k].equal(full[k]) for k in full))
    out["ema_plain"] = all(type(p) is nn.Parameter for p in ema.parameters())
    ref_ema = copy.deepcopy(ref)
    # a view kept past the scope raises instead of reading freed memory (zero3/fsdp)
    try:
        inside["0.weight"].sum().item()
        out["stale_view"] = "value"
    except UnshardedParameterError as e:
        out["stale_view"] = "error" if "0.weight" in str(e) else str(e)

    # --- nesting: the inner scope gathers nothing; the outer frees
    with acc.gathered_parameters(model):
        with mixprec.GatheredParameters([model[0].weight]):
            pass
        out["nested_inner_exit"] = model[0].weight.sum().item() == full["0.weight"].sum().item()
    # rank0_only: rank 0 reads; on zero3/fsdp the others hold nothing inside
    with acc.gathered_parameters(model, rank0_only=True):
        try:
            out["rank0_only"] = model[3].weight.sum().item() == full["3.weight"].sum().item()
        except UnshardedParameterError:
            out["rank0_only"] = "error"

    # --- re-initialise a layer through the context on rank 0 only, then train on
    step(1)
    update_ema()
    with acc.gathered_parameters(model[3], modifier_rank=0), torch.no_grad():
        if rank == 0:
            nn.init.constant_(model[3].weight, 0.01)
            model[3].bias.zero_()
        else:
            model[3].weight.fill_(7.0)  # discarded: rank 0's values are broadcast
    with torch.no_grad():
        nn.init.constant_(ref[3].weight, 0.01)
        ref[3].bias.zero_()
    after_edit = acc.get_state_dict(model)
    out["edit_reached_masters"] = bool(after_edit["3.weight"].eq(0.01).all() and after_edit["3.bias"].eq(0).all())
    # writeback=True (FSDP1's summon_full_params): every rank makes the same edit
    with mixprec.summon_full_params(model):
        with torch.no_grad():
            model[2].bias.add_(0.5)
    with torch.no_grad():
        ref[2].bias.add_(0.5)
    for i in range(2, 5):
        step(i)
        update_ema()

    def worst(a, b):
        return max(((a[k].float() - b[k].float()).abs().max() / (b[k].abs().max() + 1e-12)).item() for k in b)

    out["trained"] = worst(acc.get_state_dict(model), ref.state_dict())
    out["ema"] = worst(ema.state_dict(), ref_ema.state_dict())
    with acc.gathered_parameters(model):
        out["read_after_train"] = worst({k: v.detach().clone() for k, v in model.state_dict().items()},
                                        ref.state_dict())
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_parameters_outside_forward(backend):
    world = 1 if backend == "single" else 2  # single refuses WORLD_SIZE=2
    for rank, out in enumerate(run_distributed(_checks, world, args=(backend, BACKENDS[backend]), timeout=240)):
        assert out["same_objects"] and out["state_dict_keys"]
        sharded = backend in SHARDS_PARAMS
        if sharded:
            kind, message, params, units = out["outside"]
            assert kind == "error" and params == ("0.weight",) and units == ("0",), out["outside"]
            assert "'0.weight'" in message and "gathered_parameters" in message and "get_state_dict" in message
            assert out["state_dict"][0] == "error" and "get_state_dict" in out["state_dict"][1]
            assert "not gathered" in out["repr"] and "'0.weight'" in out["repr"]
            assert "gathered_parameters" in out["pickle_outside"]
            assert out["stale_view"] == "error"
            assert out["rank0_only"] == (True if rank == 0 else "error"), out["rank0_only"]
        else:
            assert out["outside"][0] == "value" and out["outside"][1] <= 1e-5, out["outside"]
            assert out["state_dict"] == ("value", True)
            assert out["pickle_outside"] == "ok"
            assert out["stale_view"] == "value"
            assert out["rank0_only"] is True
        assert out["meta"] == ((64, 16), __import__("torch").float32, True, 1024, True, True)
        assert out["print"].startswith("Sequential(") and "Linear(in_features=16, out_features=64" in out["print"]
        assert out["norm"] <= 1e-5 and out["norm_full"]
        assert out["state_dict_inside"] and out["pickle"] and out["ema_plain"] and out["repr_inside"]
        assert out["nested_inner_exit"]
        assert out["edit_reached_masters"]
        assert out["trained"] <= 1e-5, out["trained"]
        assert out["ema"] <= 1e-5, out["ema"]
        assert out["read_after_train"] <= 1e-5, out["read_after_train"]


def _generate(state):
    """A tiny GPT-2 (from config, nothing downloaded) trained a step on zero3 then fsdp,
    then ``generate()``: directly, and inside the gathering context."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from mixprec import Accelerator

    rank = dist.get_rank()
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = {}
    for backend, opts in (("zero3", {"units": ["GPT2Block"]}), ("fsdp", {"units": ["GPT2Block"]})):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        acc = Accelerator(mixed_precision="no", backend=backend, cpu=True, log_policy=False,
                          engine_options=opts)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            ids = torch.randint(0, 64, (4, 16), generator=g)
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        direct = model.generate(prompt, **kwargs)
        with acc.gathered_parameters(model):
            inside = model.generate(prompt, **kwargs)
            plain = copy.deepcopy(model)  # full values, no unit hooks
        # reference: a fresh GPT-2 loaded with the fp32 state
        torch.manual_seed(0)
        fresh = GPT2LMHeadModel(config)
        fresh.load_state_dict(acc.get_state_dict(model))
        expected = fresh.generate(prompt, **kwargs)
        out[backend] = (direct.tolist(), inside.tolist(), plain.generate(prompt, **kwargs).tolist(),
                        expected.tolist())
        # training goes on after generate
        ids = torch.randint(0, 64, (4, 16), generator=g)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        out[backend + "_after"] = acc.engine.param_buffer_bytes()
    return out


def test_hf_generate_mid_training_zero3_fsdp():
    pytest.importorskip("transformers")
    ranks = run_distributed(_generate, 2, timeout=300)
    for out in ranks:
        for backend in SHARDS_PARAMS:
            direct, inside, plain, expected = out[backend]
            assert direct == inside == plain == expected, (backend, out[backend])
            assert len(expected[0]) == 10
            assert out[backend + "_after"] == 0  # nothing left gathered
    assert ranks[0] == ranks[1]


@pytest.mark.parametrize("backend", SHARDS_PARAMS)
def test_ema_example_runs_with_two_processes(backend):
    import math
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "ema.py"
    out = subprocess.run([sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", "2", str(example),
                          "--backend", backend, "--steps", "40"],
                         capture_output=True, text=True, timeout=300, cwd=example.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"^final: eval loss ([\d.]+), EMA eval loss ([\d.]+) .*backend (\w+), (\d) process",
                       out.stdout, re.M)
    assert len(found) == 1, out.stdout  # printed by the main process only
    model_loss, ema_loss, got_backend, processes = found[0]
    assert (got_backend, processes) == (backend, "2")
    assert math.isfinite(float(model_loss)) and math.isfinite(float(ema_loss))
