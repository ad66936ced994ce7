"""Accelerate's Accelerator API on mixprec, one process (issue #15); two-process behaviour is in
tests/distributed/test_accelerate_semantics.py and test_accelerate_compat.py."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from mixprec import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)


def _acc(**kwargs):
    return Accelerator(cpu=True, log_policy=False, **kwargs)


# ----------------------------------------------------------------------------- state
def test_state_has_accelerates_names():
    acc = _acc()
    s = acc.state
    assert (s.num_processes, s.process_index, s.local_process_index) == (1, 0, 0)
    assert s.device == torch.device("cpu") and s.mixed_precision == "no"
    assert s.distributed_type == DistributedType.NO == "NO" and acc.distributed_type == "NO"
    assert not acc.use_distributed and acc.is_last_process and s.is_last_process
    with pytest.raises(Exception, match="cannot be assigned"):
        s.num_processes = 3
    s.debug = True  # Accelerate scripts toggle it
    assert s.debug is True


def test_accelerate_distributed_type_members_compare_equal():
    accelerate = pytest.importorskip("accelerate")
    assert _acc().state.distributed_type == accelerate.DistributedType.NO


# ----------------------------------------------------------------------------- decorators
def test_process_decorators(capsys):
    acc = _acc()
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_local_main_process(lambda: calls.append("local"))()
    acc.on_last_process(lambda: calls.append("last"))()
    acc.on_process(lambda: calls.append("p0"), process_index=0)()

    @acc.on_main_process
    def decorated(x):
        return x + 1

    assert calls == ["main", "local", "last", "p0"] and decorated(1) == 2
    with pytest.raises(ValueError, match="process_index=1 must be an int in 0..0"):
        acc.on_process(lambda: None, process_index=1)


# ----------------------------------------------------------------------------- options
def test_dataloader_config_maps_onto_settings():
    acc = _acc(dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False, data_seed=3))
    assert (acc.split_batches, acc.even_batches, acc.data_seed) == (True, False, 3)
    assert acc.dataloader_config.split_batches is True
    dispatching = _acc(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    assert dispatching.dataloader_config.dispatch_batches is True  # one process: nothing to dispatch
    assert [b.tolist() for (b,) in dispatching.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))] == \
        [[0, 1], [2, 3], [4]]
    # Assigned, it applies to the dataloaders prepared from then on (Accelerate's setter).
    acc.dataloader_config = DataLoaderConfiguration(split_batches=False, even_batches=True)
    assert (acc.split_batches, acc.even_batches, acc.data_seed) == (False, True, None)
    with pytest.raises(ValueError, match="split_batches=False conflicts with dataloader_config.split_batches=True"):
        _acc(split_batches=False, dataloader_config=DataLoaderConfiguration(split_batches=True))
    with pytest.raises(TypeError, match="must be a mixprec.DataLoaderConfiguration"):
        _acc(dataloader_config={"split_batches": True})


def test_accelerates_own_option_objects_are_accepted():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import GradientAccumulationPlugin as Plugin

    acc = _acc(dataloader_config=accelerate.DataLoaderConfiguration(even_batches=False),
               gradient_accumulation_plugin=Plugin(num_steps=3, sync_each_batch=True))
    assert acc.even_batches is False and acc.gradient_accumulation_steps == 3
    assert acc.gradient_state.sync_each_batch is True


def test_accelerates_kwargs_handlers_are_accepted():
    pytest.importorskip("accelerate")
    from accelerate.utils import DDPCommunicationHookType
    from accelerate.utils import DistributedDataParallelKwargs as DDPKwargs
    from accelerate.utils import GradScalerKwargs as ScalerKwargs

    acc = _acc(backend="ddp", kwargs_handlers=[DDPKwargs(find_unused_parameters=True)])
    assert acc.config.engine_options()["find_unused_parameters"] is True
    acc.end_training()
    with pytest.raises(ValueError, match="has no communication hooks"):
        _acc(kwargs_handlers=[DDPKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    try:
        fp16 = _acc(mixed_precision="fp16", kwargs_handlers=[ScalerKwargs(init_scale=256.0)])
    except ValueError as e:  # a CPU without fp16 autocast
        pytest.skip(f"fp16 not available here: {e}")
    assert fp16.loss_scale == 256.0


def test_gradient_accumulation_plugin():
    acc = _acc(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.num_steps == 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 conflicts with gradient_accumulation_plugin.num_steps=4"):
        _acc(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    with pytest.raises(ValueError, match="sync_with_dataloader=False is not supported"):
        _acc(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False))


def test_kwargs_handlers():
    acc = _acc(backend="ddp", kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=5)])
    options = acc.config.engine_options()
    assert options["find_unused_parameters"] is True and options["bucket_cap_mb"] == 5
    acc.end_training()
    # Other backends ignore DDP options, as Accelerate does outside DDP.
    assert _acc(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]).backend == "single"
    with pytest.raises(ValueError, match="static_graph=True has no counterpart"):
        _acc(kwargs_handlers=[DistributedDataParallelKwargs(static_graph=True)])
    with pytest.raises(ValueError, match="two InitProcessGroupKwargs"):
        _acc(kwargs_handlers=[InitProcessGroupKwargs(), InitProcessGroupKwargs()])
    with pytest.raises(ValueError, match="GradScalerKwargs\\(enabled=False\\)"):
        _acc(kwargs_handlers=[GradScalerKwargs(enabled=False)])

    class ProfileKwargs:
        pass

    with pytest.raises(ValueError, match="ProfileKwargs is not supported by mixprec; use torch.profiler"):
        _acc(kwargs_handlers=[ProfileKwargs()])


def test_grad_scaler_kwargs_set_the_fp16_scaler():
    try:
        acc = _acc(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=7)])
    except ValueError as e:  # a CPU without fp16 autocast
        pytest.skip(f"fp16 not available here: {e}")
    assert acc.loss_scale == 1024.0
    assert acc.policy.scaler.growth_interval == 7


# ----------------------------------------------------------------------------- dataloaders
def test_prepared_loader_is_a_dataloader_and_preparing_twice_is_harmless():
    acc = _acc()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    assert isinstance(loader, DataLoader) and acc.prepare(loader) is loader
    assert loader.batch_size == 4 and len(loader) == 3
    assert [x.tolist() for (x,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_custom_batch_samplers_are_accepted():
    acc = _acc()

    class Pairs:  # a batch sampler that is not a torch BatchSampler
        def __iter__(self):
            yield from ([i, i + 1] for i in range(0, 6, 2))

        def __len__(self):
            return 3

    ds = TensorDataset(torch.arange(6))
    a = acc.prepare(DataLoader(ds, batch_sampler=Pairs()))
    b = acc.prepare(DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 4, False)))
    assert [x.tolist() for (x,) in a] == [[0, 1], [2, 3], [4, 5]]
    assert [x.tolist() for (x,) in b] == [[0, 1, 2, 3], [4, 5]]


def test_skip_first_batches():
    acc = _acc()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    skipped = acc.skip_first_batches(loader, 3)
    assert isinstance(skipped, DataLoader) and len(skipped) == 2
    assert [x.tolist() for (x,) in skipped] == [[6, 7], [8, 9]]
    assert len([b for b in loader]) == 5  # the original is unchanged
    with pytest.raises(TypeError, match="prepare it first"):
        acc.skip_first_batches(DataLoader(list(range(4))), 1)
    with pytest.raises(ValueError, match="num_batches=-1"):
        acc.skip_first_batches(loader, -1)


def test_skip_first_batches_after_load_state_continues_the_checkpointed_pass(tmp_path):
    """Issue #36 point 2 on one process: load_state + skip_first_batches(loader, n) is the
    checkpointed pass from batch n on, then the next pass is the uninterrupted run's next
    order; a different n is skipped as asked, with a warning naming the checkpoint's."""
    def run():
        torch.manual_seed(0)
        acc = _acc()
        return acc, acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True))

    acc, loader = run()
    full = []
    for epoch in range(2):
        for i, (x,) in enumerate(loader):
            full.append(x.tolist())
            if epoch == 0 and i == 1:
                acc.save_state(str(tmp_path / "ck"))
    acc, loader = run()
    acc.load_state(str(tmp_path / "ck"))
    skipped = acc.skip_first_batches(loader, 2)
    assert len(skipped) == 4
    assert [x.tolist() for (x,) in skipped] + [x.tolist() for (x,) in loader] == full[2:]
    acc, loader = run()
    acc.load_state(str(tmp_path / "ck"))
    with pytest.warns(UserWarning, match=r"skip_first_batches\(loader, 3\) after load_state\(\).*after batch 2"):
        assert [x.tolist() for (x,) in acc.skip_first_batches(loader, 3)] == full[3:6]


def test_seedable_sampler_on_one_process_changes_order_per_epoch_and_replays_after_set_epoch():
    acc = _acc(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True))
    first = [torch.cat([x for (x,) in loader]).tolist() for _ in range(2)]
    assert first[0] != first[1]
    loader.set_epoch(0)
    assert torch.cat([x for (x,) in loader]).tolist() == first[0]


def test_device_placement_false_leaves_batches_alone():
    acc = _acc(device_placement=False)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    assert loader.device is None and [x.tolist() for (x,) in loader] == [[0, 1], [2, 3]]


def test_active_dataloader():
    acc = _acc()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    assert acc.gradient_state.active_dataloader is None
    seen = [acc.gradient_state.active_dataloader is loader for _ in loader]
    assert seen == [True, True] and acc.gradient_state.active_dataloader is None


# ----------------------------------------------------------------------------- collectives
def test_reduce_max_and_scale_and_trigger():
    acc = _acc()
    t = torch.tensor([1.0, -2.0])
    assert acc.reduce(t, "max").tolist() == [1.0, -2.0]
    assert acc.reduce(t, "sum", scale=0.5).tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match="reduction='prod' is not supported"):
        acc.reduce(t, "prod")
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False


def test_trigger_sync_in_backward():
    acc = _acc()
    model = acc.prepare(torch.nn.Linear(2, 1))
    with acc.trigger_sync_in_backward(model):
        acc.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None
    with acc.no_sync(model), pytest.raises(RuntimeError, match="leave the no_sync block"):
        with acc.trigger_sync_in_backward(model):
            pass
    with pytest.raises(ValueError, match="did not prepare"):
        with acc.trigger_sync_in_backward(torch.nn.Linear(1, 1)):
            pass


# ----------------------------------------------------------------------------- saving
def test_save(tmp_path):
    acc = _acc()
    acc.save({"a": torch.ones(2)}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt")["a"].tolist() == [1.0, 1.0]
    acc.save({"a": torch.ones(2)}, tmp_path / "x.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert load_file(tmp_path / "x.safetensors")["a"].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="dict of name -> tensor"):
        acc.save([1, 2], tmp_path / "y.safetensors", safe_serialization=True)


def test_save_model_shards_and_formats(tmp_path):
    from safetensors.torch import load_file

    acc = _acc()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    single = acc.save_model(model, tmp_path / "one")
    assert single.endswith("model.safetensors")
    assert all(torch.equal(load_file(single)[k], v) for k, v in full.items())
    index = acc.save_model(model, tmp_path / "sharded", max_shard_size="300B")
    meta = json.loads(Path(index).read_text())
    files = sorted(set(meta["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {k: load_file(tmp_path / "sharded" / f)[k] for k, f in meta["weight_map"].items()}
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[k], v) for k, v in full.items())
    assert meta["metadata"]["total_size"] == sum(v.numel() * 4 for v in full.values())
    binary = acc.save_model(model, tmp_path / "bin", safe_serialization=False)
    assert binary.endswith("pytorch_model.bin")
    assert all(torch.equal(torch.load(binary)[k], v) for k, v in full.items())
    with pytest.raises(ValueError, match="max_shard_size='ten'"):
        acc.save_model(model, tmp_path / "x", max_shard_size="ten")


def test_save_and_load_state_hooks(tmp_path):
    acc = _acc()
    model = acc.prepare(torch.nn.Linear(2, 1))
    seen = []

    def on_save(models, weights, output_dir):
        seen.append(("save", len(models), sorted(weights[0]), output_dir))
        (tmp_path / "ck" / "extra.txt").write_text("mine")

    handle = acc.register_save_state_pre_hook(on_save)
    acc.register_load_state_pre_hook(lambda models, input_dir: seen.append(("load", len(models), input_dir)))
    acc.save_state(str(tmp_path / "ck"))
    acc.load_state(str(tmp_path / "ck"))
    assert seen == [("save", 1, ["bias", "weight"], str(tmp_path / "ck")), ("load", 1, str(tmp_path / "ck"))]
    assert (tmp_path / "ck" / "extra.txt").read_text() == "mine"
    handle.remove()
    acc.save_state(str(tmp_path / "ck2"))
    assert len(seen) == 2
    acc.register_save_state_pre_hook(lambda models, weights, d: weights.pop())
    with pytest.raises(ValueError, match="always saves every prepared model"):
        acc.save_state(str(tmp_path / "ck3"))
    with pytest.raises(ValueError, match="safe_serialization=False"):
        acc.save_state(str(tmp_path / "ck4"), safe_serialization=False)


def test_free_memory():
    acc = _acc(mixed_precision="bf16")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    old_engine = acc.engine
    model, opt = acc.free_memory(model, opt)
    assert model is None and opt is None and acc._models == [] and acc.engine is not old_engine
    assert acc.engine.master_of == {} and acc.engine.optimizers == {}
    # The accelerator goes on with new objects.
    model = torch.nn.Linear(2, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.ones(1, 2)).sum())
    assert opt.step().stepped


# ----------------------------------------------------------------------------- trackers
def test_default_jsonl_tracker(tmp_path):
    acc = _acc(project_dir=str(tmp_path))
    acc.init_trackers("run", config={"lr": 0.1})
    acc.log({"loss": torch.tensor(0.5), "name": "a"}, step=3)
    assert acc.get_tracker("jsonl").name == "jsonl"
    acc.end_training()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"config": {"lr": 0.1}}, {"step": 3, "values": {"loss": 0.5, "name": "a"}}]
    with pytest.raises(ValueError, match="no tracker named 'jsonl'"):
        acc.get_tracker("jsonl")


def test_tensorboard_tracker(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = _acc(log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("tb", config={"lr": 0.1})
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter"
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1)}, step=step)
    acc.end_training()
    events = [p for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    scalars = []
    for path in events:
        ea = EventAccumulator(str(path))
        ea.Reload()
        if "loss" in ea.Tags()["scalars"]:
            scalars += [(e.step, e.value) for e in ea.Scalars("loss")]
    assert scalars == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]


def test_mlflow_tracker(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is optional (not in the test extra)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    acc = _acc(log_with="mlflow", project_dir=str(tmp_path))
    acc.init_trackers("mlrun", config={"lr": 0.1})
    run_id = acc.get_tracker("mlflow", unwrap=True).info.run_id
    acc.log({"loss": 0.25}, step=1)
    acc.end_training()
    import mlflow

    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.25)]
    assert client.get_run(run_id).data.params == {"lr": "0.1"}


def test_wandb_tracker(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (not in the test extra)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    acc = _acc(log_with="wandb", project_dir=str(tmp_path))
    acc.init_trackers("wbrun", config={"lr": 0.1}, init_kwargs={"wandb": {"mode": "offline"}})
    run = acc.get_tracker("wandb", unwrap=True)
    acc.log({"loss": 0.2578125}, step=1)
    assert run.config["lr"] == 0.1
    acc.end_training()
    files = list(tmp_path.rglob("*.wandb"))
    assert len(files) == 1, f"wandb wrote {files}"
    # The offline run file is a log of protobuf records; the history row is in it verbatim.
    data = files[0].read_bytes()
    assert b"loss" in data and b"0.2578125" in data


def test_log_with_errors(tmp_path):
    with pytest.raises(ValueError, match="log_with='nope' is not a tracker"):
        _acc(log_with="nope")
    acc = _acc(log_with="jsonl", project_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="before init_trackers\\(\\): log_with='jsonl'"):
        acc.log({"a": 1})
    _acc().log({"a": 1})  # no log_with: a no-op before init_trackers, as in Accelerate
    with pytest.raises(ValueError, match="init_kwargs has keys \\['wandb'\\]"):
        acc.init_trackers("x", init_kwargs={"wandb": {}})


def test_custom_tracker_object(tmp_path):
    class Mine:
        name = "mine"
        tracker = None

        def __init__(self):
            self.rows = []

        def store_init_configuration(self, values):
            self.rows.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, values))

        def finish(self):
            self.rows.append("finished")

    mine = Mine()
    acc = _acc(log_with=[mine])
    acc.init_trackers("p", config={"a": 1})
    acc.log({"x": 2}, step=0)
    acc.end_training()
    assert mine.rows == [("config", {"a": 1}), (0, {"x": 2}), "finished"]


def test_prepared_model_pickles_as_the_users_class_and_deepcopies_prepared():
    """torch.save(model) of a prepared model (Accelerate allows it) stores the user's own
    classes: it loads without mixprec, as a module never prepared. A deepcopy (an EMA copy)
    keeps the policy's forward."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 4))
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False, keep_fp32_modules=("LayerNorm",))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.randn(2, 256)).float().sum())
    opt.step()
    assert b"mixprec" not in pickle.dumps(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [torch.nn.Sequential, torch.nn.Linear, torch.nn.LayerNorm,
                                                   torch.nn.Linear]
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    twin = copy.deepcopy(model)
    x = torch.randn(3, 256)
    assert hasattr(twin, "_mixprec_ctx") and twin(x).dtype == torch.float32
    assert torch.equal(twin(x), model(x)) and twin[0].weight is not model[0].weight


# ----------------------------------------------------------------------------- pickling
def test_accelerator_pickles_settings_and_trains_after_unpickling():
    import pickle

    acc = _acc(mixed_precision="bf16", gradient_accumulation_steps=2, nonfinite_grads="raise")
    model = torch.nn.Linear(2, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 1))
    again = pickle.loads(pickle.dumps(acc))
    assert again.state.__dict__ == acc.state.__dict__
    assert (again.mixed_precision, again.gradient_accumulation_steps, again.backend) == ("bf16", 2, "single")
    assert again.prepared.models == [] and again._checkpoint_objects == []  # prepared objects are not carried
    m = torch.nn.Linear(2, 1)
    m, opt = again.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert again.engine.nonfinite_grads == "raise"  # the engine's settings were carried
    before = m.weight.detach().clone()
    for _ in range(2):
        with again.accumulate(m):
            again.backward(m(torch.ones(2, 2)).sum())
            opt.step()
            opt.zero_grad()
    assert not torch.equal(before, m.weight.detach()) and again.last_step.stepped


def test_partial_and_accelerator_state_are_backed_by_the_live_accelerator():
    from mixprec.compat import state as compat_state

    # _reset_state() would also reset Accelerators other tests of this process still hold.
    others = [r() for r in compat_state._ACCELERATORS if r() is not None]
    try:
        _state_objects()
    finally:
        for acc in others:
            acc.__dict__.pop("_state_reset", None)


def _state_objects():
    from mixprec import AcceleratorState, PartialState

    first = _acc(mixed_precision="bf16")
    assert AcceleratorState() is first.state and PartialState() is first.state
    s = AcceleratorState()
    assert (s.num_processes, s.process_index, s.local_process_index, s.mixed_precision, s.initialized) == (1, 0, 0, "bf16", True)
    assert s.distributed_type == DistributedType.NO and s.device == torch.device("cpu")
    second = _acc()
    assert AcceleratorState() is second.state and AcceleratorState().mixed_precision == "no"
    AcceleratorState._reset_state()
    assert not first.state.initialized and not second.state.initialized
    with pytest.raises(AttributeError, match=r"AcceleratorState._reset_state\(\)"):
        second.prepare(torch.nn.Linear(1, 1))
    third = _acc()
    assert AcceleratorState() is third.state and third.state.initialized
    third.prepare(torch.nn.Linear(1, 1))
    third.end_training()
    alone = PartialState()  # no live Accelerator: read from the environment (one process here)
    assert alone is PartialState() and (alone.num_processes, alone.initialized) == (1, True)
    # With fields it is a plain new state object, as before.
    assert AcceleratorState(rank=0, world_size=1).num_processes == 1


def test_stateful_dataloader_without_torchdata_names_the_fix(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchdata", None)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match=r"use_stateful_dataloader=True needs torchdata.*pip install torchdata"):
        _acc(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    acc = _acc()
    with pytest.raises(ImportError, match="pip install torchdata"):
        acc.dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)


def test_stateful_dataloader_single_process_resumes(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    acc = _acc(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=3, shuffle=True))
    got = []
    for step, (b,) in enumerate(loader):
        if step == 1:
            state = loader.state_dict()
        elif step > 1:
            got.append(b.tolist())
    loader.load_state_dict(state)
    assert [b.tolist() for (b,) in loader] == got and len(got) == 5
    # A checkpoint's loader state resumes only with the same layout: refused before loading.
    for (b,) in loader:
        acc.save_state(str(tmp_path / "ckpt"))
        break
    other = _acc(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    other.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=4))
    with pytest.raises(Exception, match="global batch of 3; this run has 1 and 4"):
        other.load_state(str(tmp_path / "ckpt"))


def test_skip_first_batches_after_a_loaded_stateful_position_is_refused():
    """use_stateful_dataloader: the loaded state already positions the next pass, so
    skip_first_batches(loader, n > 0) right after it raises instead of dropping n more
    batches; any pass (the loader's or a skipping one) consumes the loaded position."""
    from mixprec.checkpoint.dataloader import StatefulPreparedDataLoader
    from mixprec.gradient_state import GradientState

    class Positioned(DataLoader):  # torchdata's protocol: load_state_dict positions the next pass
        skip = 0

        def state_dict(self):
            return {"skip": self.skip}

        def load_state_dict(self, state):
            self.skip = state["skip"]

        def __iter__(self):
            it = super().__iter__()
            for _ in range(self.skip):
                next(it)
            self.skip = 0
            return it

    acc = _acc()
    loader = StatefulPreparedDataLoader(Positioned(TensorDataset(torch.arange(8)), batch_size=2), None, GradientState(1))
    loader.load_state_dict({"skip": 1})
    with pytest.raises(ValueError, match=r"skip_first_batches\(loader, 2\) on a use_stateful_dataloader loader whose "
                                         r"state was just loaded.*iterate the loader itself"):
        acc.skip_first_batches(loader, 2)
    assert [x.tolist() for (x,) in acc.skip_first_batches(loader, 0)] == [[2, 3], [4, 5], [6, 7]]
    assert [x.tolist() for (x,) in acc.skip_first_batches(loader, 2)] == [[4, 5], [6, 7]]  # consumed: allowed again
