"""Which modules become zero3/fsdp sharding units, and what happens when a unit is read
while not gathered (src/mixprec/engines/units.py, [Note: units are called])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from mixprec.engines.units import LeafSpec, assign_params, select_unit_modules, set_leaf_modules
from mixprec.errors import UnshardedParameterError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + torch.relu(self.fc(x)))


class ListNet(nn.Module):
    """Layers in a ModuleList, each under the size threshold, together above it."""

    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _names(units):
    return [n for n, _ in units]


def test_size_policy_never_makes_a_module_list_a_unit_its_children_become_units():
    model = ListNet(d=32, depth=4)  # a Block holds 1,120 params; the list 4,480
    units = select_unit_modules(model, "size:2000")
    assert _names(units) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert not any(isinstance(m, nn.ModuleList) for _, m in units)


def test_size_policy_splits_nested_containers():
    model = nn.Sequential(nn.ModuleDict({"a": nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)]),
                                         "b": nn.Linear(10, 10)}))
    units = select_unit_modules(model, "size:200")
    # The list (220 params) is split; what is left in the dict (0.b, 110) stays with the root.
    assert _names(units) == ["0.a.0", "0.a.1"]


def test_class_list_naming_a_container_is_refused():
    with pytest.raises(ValueError, match=r"ModuleList.*never called.*block class"):
        select_unit_modules(ListNet(), ["ModuleList"])


def test_tied_weight_goes_to_the_unit_holding_both_users_else_the_root():
    model = ListNet(d=8, depth=2)
    model.head = nn.Linear(8, 8)
    model.head.weight = model.layers[0].fc.weight  # tied across units
    units = select_unit_modules(model, ["Block"])
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    owner = assign_params(model, units, names, params)
    tied = names.index("layers.0.fc.weight")
    assert tied in owner[-1]  # the root: read by layers.0 and by head
    assert names.index("layers.0.fc.bias") in owner[0]


def test_leaf_modules_are_units_with_no_unit_inside():
    model = ListNet(d=16, depth=3)
    leaves = LeafSpec(names=("layers.1",))
    units = select_unit_modules(model, ["Linear"], leaves)
    names = _names(units)
    assert "layers.1" in names
    assert not any(n.startswith("layers.1.") for n in names)
    assert "layers.0.fc" in names and "layers.2.fc" in names


def test_leaf_by_class_suffix_and_marker():
    model = ListNet(d=16, depth=2)
    assert _names(select_unit_modules(model, None, LeafSpec(classes=("Block",)))) == ["layers.0", "layers.1"]
    assert _names(select_unit_modules(model, None, LeafSpec(name_suffixes=("1",)))) == ["layers.1"]
    assert set_leaf_modules(model, [Block]) == ["layers.0", "layers.1"]
    assert _names(select_unit_modules(model, "size:10**9".replace("10**9", "1000000000"))) == ["layers.0", "layers.1"]


def test_leaf_spec_that_matches_nothing_names_it():
    with pytest.raises(ValueError, match=r"\['Expert'\] match no module.*ListNet.*Block"):
        LeafSpec(classes=("Expert",)).check(ListNet())


class ReadsOutsideForward(nn.Module):
    """The parent reads a unit's weight directly, after the unit ran and was freed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Block(8)
        self.b = Block(8)

    def forward(self, x):
        h = self.b(self.a(x))
        return h @ self.a.fc.weight.t()


def test_unit_read_while_not_gathered_is_named_with_module_unit_and_fix():
    torch.manual_seed(0)
    acc = Accelerator(backend="zero3", mixed_precision="bf16", log_policy=False,
                      engine_options={"units": ["Block"]})
    try:
        model = acc.prepare(ReadsOutsideForward())
        with pytest.raises(UnshardedParameterError) as info:
            model(torch.randn(2, 8))
        err = info.value
        assert "a.fc.weight" in err.params and err.units == ("a",)
        message = str(err)
        assert "<root>" in message and "already freed after its forward" in message
        assert "leaf module" in message and "units=[]" in message
        assert isinstance(err, RuntimeError)  # existing `except RuntimeError` still catches it
    finally:
        acc.end_training()


@pytest.mark.parametrize("backend", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_every_distributed_backend_runs_in_one_process_and_matches_single(backend):
    """World size 1: one config serves a laptop and a cluster (a one-process group is made)."""

    def train(name):
        torch.manual_seed(0)
        model = ListNet(d=16, depth=2)
        acc = Accelerator(backend=name, mixed_precision="bf16", log_policy=False)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            acc.backward(model(torch.randn(4, 8, generator=g)).square().mean())
            # (no clipping: the sharded norm sums per-shard squares, a different order)
            result = opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        assert acc.backend == name and acc.num_processes == 1
        acc.end_training()
        return state, result

    ref, _ = train("single")
    got, result = train(backend)
    assert result.stepped
    assert not torch.distributed.is_initialized()  # end_training removed the one-process group
    for key in ref:
        assert torch.equal(got[key], ref[key]), key


def test_deepspeed_leaf_module_config_is_imported_into_the_zero3_block(tmp_path):
    import json

    from mixprec.config.importers import import_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "leaf_module": {"classes": ["my.models.MoEBlock"], "names": ["layers.3.moe"],
                                    "name_suffixes": ["moe"], "bogus": [1]}}}))
    report = import_config(str(path))
    zero3 = report.config["zero3"]
    assert zero3["leaf_module_classes"] == ("my.models.MoEBlock",)
    assert zero3["leaf_module_names"] == ("layers.3.moe",)
    assert zero3["leaf_module_name_suffixes"] == ("moe",)
    assert "zero_optimization.leaf_module.bogus" in report.text()
    # DeepSpeed gives qualified class names; mixprec matches them by the class's own name too.
    assert LeafSpec(classes=("my.models.Block",)).matches("x", Block(4)) is False
    assert LeafSpec(classes=(f"{Block.__module__}.Block",)).matches("x", Block(4)) is True


@pytest.mark.parametrize("backend", ["zero1", "zero2", "zero3", "fsdp"])
def test_zero_reduces_in_the_policys_reduce_dtype(backend):
    """[Note: low-precision reduction]: the fp32-accumulated gradient is rounded once to
    bf16 for the collective (half the bytes) and lands in the fp32 shard (one process: the
    sum is the rank's own gradient, so the shard is exactly its bf16 rounding)."""
    from mixprec import PrecisionPolicy

    def shard_grads(reduce_dtype):
        policy = PrecisionPolicy.from_mixed_precision("no", reduce_dtype=reduce_dtype)
        acc = Accelerator(backend=backend, policy=policy, log_policy=False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.engine.reset_comm_counters()
        acc.backward(model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().mean())
        acc.engine.fold_grads()
        grads = torch.cat([g.flatten() for g in acc.engine.comm.all_segment_grads()]).clone()
        sent = acc.engine.comm_counters()["bytes_reduced"]
        acc.end_training()
        return grads, sent

    fp32, fp32_bytes = shard_grads(torch.float32)
    bf16, bf16_bytes = shard_grads(torch.bfloat16)
    assert bf16_bytes * 2 == fp32_bytes
    assert torch.equal(bf16, fp32.to(torch.bfloat16).float())
    assert not torch.equal(bf16, fp32)  # really rounded: the collective ran in bf16
