"""Issue #48 point 6: every public method and property of the installed
``accelerate.Accelerator`` exists on :class:`mixprec.Accelerator` with a compatible
signature, or is a deliberate gap listed here with its reason (docs/migrating.md repeats
them). Names alone are not enough (tests/test_accelerate_names.py compares those).

Compatible: every parameter of Accelerate's method is in mixprec's, of the same kind
(positional or keyword), with the same default where Accelerate's is a plain value, the
positional ones in the same order; mixprec's extra parameters come after them and have
defaults, so a call written for Accelerate binds the same way. A gap that disappears fails
too, so the lists only shrink. The other tests here check what the new parameters do.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

import mixprec  # noqa: E402

_PARALLELISM = ("Accelerate's ParallelismConfig/DeviceMesh (composable FSDP2 + TP + CP); mixprec's mesh is "
                "accelerator.mesh (dp, sp, tp) from the config's tensor_parallel/sequence_parallel sections")
# Public names of accelerate.Accelerator that mixprec.Accelerator does not have.
MISSING = {
    "data_parallel_rank": _PARALLELISM + "; the data-parallel rank is accelerator.mesh.dp_rank (or process_index)",
    "data_parallel_shard_rank": _PARALLELISM,
    "torch_device_mesh": _PARALLELISM,
    "should_save_model": _PARALLELISM + "; save_model/save_state decide which ranks write themselves",
    "is_fsdp2": "mixprec's fsdp engine is its own, not torch's FSDP2 (distributed_type says FSDP)",
    "is_composable_parallelism_enabled": "Accelerate's FSDP2 flag (see is_fsdp2)",
    "deepspeed_plugin": "no DeepSpeed: configure the backend with Accelerator(backend=..., config=...)",
    "deepspeed_ulysses_dl_adapter": "no DeepSpeed; mixprec's Ulysses is sequence_parallel.prepare_batches",
    "fp8_backend": "no fp8 training (fp8 recipes raise naming the alternative)",
    "lomo_backward": "LOMO optimizers (lomo_optim) are not supported: use accelerator.backward with a torch optimizer",
}
# Parameters of Accelerate's methods that mixprec's do not take: {method: {parameter: reason}}.
PARAMETER_GAPS: dict[str, dict[str, str]] = {}

_PLAIN = (type(None), bool, int, float, str)


def _theirs(cls: type, name: str):
    """The function behind ``cls.name``, through Accelerate's undecorated process decorators
    (``on_main_process`` wraps ``init_trackers``/``log`` in ``(*args, **kwargs)``)."""
    fn = getattr(cls, name)
    params = list(inspect.signature(fn).parameters.values())
    if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        inner = [c.cell_contents for c in (fn.__closure__ or ()) if callable(c.cell_contents)
                 and getattr(c.cell_contents, "__name__", None) == name]
        if inner:
            return inner[0]
    return fn


def _parameters(cls: type, name: str, fn) -> list[inspect.Parameter]:
    """``fn``'s parameters as a caller sees them (no ``self``)."""
    params = list(inspect.signature(fn).parameters.values())
    if not isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod)):
        params = params[1:]
    return params


def _differences(name: str, theirs: list, ours: list) -> dict[str, str]:
    """{Accelerate's parameter (or a mixprec one): what is incompatible}."""
    P = inspect.Parameter
    by_name = {p.name: p for p in ours}
    out = {}
    for p in theirs:
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if not any(q.kind == p.kind for q in ours):
                out[p.name] = f"mixprec's {name} has no {'*' if p.kind == P.VAR_POSITIONAL else '**'}parameter"
            continue
        q = by_name.get(p.name)
        if q is None:
            out[p.name] = "missing"
        elif q.kind != p.kind:
            out[p.name] = f"kind {p.kind.description} in Accelerate, {q.kind.description} in mixprec"
        elif p.default is not P.empty and q.default is P.empty:
            out[p.name] = f"optional in Accelerate (default {p.default!r}), required in mixprec"
        elif isinstance(p.default, _PLAIN) and (q.default != p.default or isinstance(q.default, bool)
                                                != isinstance(p.default, bool)):  # 2 == 2.0, True != 1
            out[p.name] = f"default {p.default!r} in Accelerate, {q.default!r} in mixprec"
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    their_order = [p.name for p in theirs if p.kind in positional and p.name in by_name]  # missing: said above
    our_order = [q.name for q in ours if q.kind in positional]
    if our_order[:len(their_order)] != their_order:
        out["(order)"] = f"positional parameters {their_order} in Accelerate, {our_order} in mixprec"
    known = {p.name for p in theirs}
    for q in ours:
        if q.name not in known and q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) \
                and q.default is P.empty:
            out[q.name] = "mixprec's extra parameter is required (a call written for Accelerate lacks it)"
    return out


def _public_names() -> list[str]:
    return sorted(n for n in dir(accelerate.Accelerator) if not n.startswith("_"))


def _acc(**kwargs):
    return mixprec.Accelerator(cpu=True, log_policy=False, **kwargs)


def test_every_accelerate_method_and_property_has_a_compatible_signature_or_is_a_listed_gap():
    acc = _acc()
    ours_present = set(dir(acc))
    missing, stale, mismatched, stale_params, kinds = [], [], {}, [], []
    for name in _public_names():
        static = inspect.getattr_static(accelerate.Accelerator, name)
        if name not in ours_present:
            if name not in MISSING:
                missing.append(name)
            continue
        if name in MISSING:
            stale.append(name)
            continue
        their_method = callable(getattr(accelerate.Accelerator, name)) and not isinstance(static, property)
        our_method = not isinstance(inspect.getattr_static(mixprec.Accelerator, name, None), property) \
            and callable(getattr(mixprec.Accelerator, name, None))
        if their_method != our_method:
            kinds.append(f"{name}: {'method' if their_method else 'property'} in Accelerate")
            continue
        if not their_method:
            continue
        diffs = _differences(
            name, _parameters(accelerate.Accelerator, name, _theirs(accelerate.Accelerator, name)),
            _parameters(mixprec.Accelerator, name, getattr(mixprec.Accelerator, name)))
        gaps = PARAMETER_GAPS.get(name, {})
        undeclared = {k: v for k, v in diffs.items() if k not in gaps}
        if undeclared:
            mismatched[name] = undeclared
        stale_params += [f"{name}({k}=)" for k in gaps if k not in diffs]
    assert not missing, f"accelerate.Accelerator names mixprec's lacks, not listed in MISSING: {missing}"
    assert not stale, f"listed in MISSING but mixprec has them now (drop them, and from docs/migrating.md): {stale}"
    assert not kinds, f"a method in one and a property in the other: {kinds}"
    assert not mismatched, f"signatures incompatible with Accelerate's, not listed in PARAMETER_GAPS: {mismatched}"
    assert not stale_params, f"listed in PARAMETER_GAPS but compatible now (drop them): {stale_params}"
    assert len(_public_names()) > 80  # the comparison really ran over Accelerate's API


def test_the_comparison_catches_each_kind_of_difference():
    P = inspect.Parameter

    def sig(*params):
        return list(params)

    a = P("a", P.POSITIONAL_OR_KEYWORD)
    b = P("b", P.POSITIONAL_OR_KEYWORD, default=None)
    assert _differences("f", sig(a, b), sig(a, b)) == {}
    assert _differences("f", sig(a, b), sig(a)) == {"b": "missing"}
    assert "default None in Accelerate, True" in _differences("f", sig(a, b), sig(a, b.replace(default=True)))["b"]
    assert "required in mixprec" in _differences("f", sig(a, b), sig(a, b.replace(default=P.empty)))["b"]
    assert "keyword-only" in _differences("f", sig(a, b), sig(a, b.replace(kind=P.KEYWORD_ONLY)))["b"]
    assert _differences("f", sig(b.replace(default=2)), sig(b.replace(default=2.0))) == {}
    assert "default 1 in Accelerate, True" in _differences("f", sig(b.replace(default=1)),
                                                           sig(b.replace(default=True)))["b"]
    assert "(order)" in _differences("f", sig(a, b), sig(b, a))
    extra = P("c", P.KEYWORD_ONLY)
    assert "extra parameter is required" in _differences("f", sig(a), sig(a, extra))["c"]
    assert _differences("f", sig(a), sig(a, extra.replace(default=1))) == {}
    # A parameter Accelerate requires may have a default in mixprec (on_last_process(function=None)).
    assert _differences("f", sig(a), sig(a.replace(default=None))) == {}
    # *args matches *objs: only the kind counts.
    assert _differences("f", sig(P("args", P.VAR_POSITIONAL)), sig(P("objs", P.VAR_POSITIONAL))) == {}


def test_migrating_note_names_every_gap():
    from pathlib import Path

    note = (Path(__file__).resolve().parents[1] / "docs" / "migrating.md").read_text()
    unnamed = [n for n in [*MISSING, *(f"{m}({p}=" for m, ps in PARAMETER_GAPS.items() for p in ps)]
               if f"`{n}" not in note]
    assert not unnamed, f"docs/migrating.md does not name these gaps: {unnamed}"


# ------------------------------------------------------------------ the new parameters' behaviour
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_prepare_device_placement_is_one_entry_per_object_and_reaches_each_prepare():
    acc = _acc()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    with pytest.raises(ValueError, match=r"device_placement=\[True\]\) has 1 entries for 3 objects"):
        acc.prepare(model, opt, dl, device_placement=[True])
    model, opt, dl = acc.prepare(model, opt, dl, device_placement=[None, True, False])
    assert dl.device is None  # False reached prepare_data_loader: batches are not moved
    assert acc._models == [model] and acc._optimizers == [opt]
    loss = model(next(iter(dl))).sum()
    acc.backward(loss)
    opt.step()


def test_prepare_model_device_placement_false_is_refused_only_for_a_model_elsewhere():
    acc = _acc()
    model = acc.prepare_model(_model(), device_placement=False)  # already on accelerator.device: honoured
    assert model in acc._models
    from mixprec.facade.preparation import _refuse_unplaced

    # Meta tensors (init_empty_weights) are the engine's to materialise: not refused.
    _refuse_unplaced("prepare_model", torch.device("cpu"), list(_model().to("meta").parameters()))
    with pytest.raises(NotImplementedError,
                       match=r"prepare_model\(device_placement=False\).*accelerator.device \(cpu\), and these are on "
                             r"cuda:1.*device_placement=None"):
        _refuse_unplaced("prepare_model", torch.device("cpu"), [torch.empty(1, device="meta"),
                                                                  _FakeOn("cuda:1")])
    assert _refuse_unplaced("x", torch.device("cuda"), [_FakeOn("cuda:0"), _FakeOn("cuda")]) is None


class _FakeOn:
    """A stand-in with only ``.device`` (no GPU here)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_prepare_optimizer_device_placement_false_keeps_state_already_on_the_device():
    acc = _acc()
    model = acc.prepare(_model())
    opt = acc.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), device_placement=False)
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    assert opt.optimizer.state  # it trains


def test_prepare_model_evaluation_mode_gives_the_policys_forward_and_is_checkpointed(tmp_path):
    acc = _acc(mixed_precision="bf16")
    reference = _model()
    expected = reference(torch.ones(3, 4))
    model = acc.prepare_model(_model(), evaluation_mode=True)
    with torch.no_grad():
        out = model(torch.ones(3, 4))
    assert model in acc._models
    assert torch.allclose(out.float(), expected, atol=0.05)
    assert out.dtype == torch.float32  # the policy's output cast, as for a training model
    with pytest.raises(TypeError, match=r"evaluation_mode='yes'\) needs a bool"):
        acc.prepare_model(_model(), evaluation_mode="yes")
    acc.save_state(str(tmp_path / "ck"))
    acc.load_state(str(tmp_path / "ck"))


def test_unwrap_model_keep_torch_compile_returns_the_compiled_module_or_its_original():
    acc = _acc()
    model = acc.prepare(_model())
    compiled = torch.compile(model)  # not run: wrapping costs nothing
    assert acc.unwrap_model(compiled) is compiled
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is model
    inner = acc.unwrap_model(compiled, keep_fp32_wrapper=False, keep_torch_compile=False)
    from mixprec.wrappers.model import is_prepared

    assert inner is model and not is_prepared(inner)  # the policy's forward removed
    plain = _model()
    assert acc.unwrap_model(plain, keep_torch_compile=False) is plain


def test_verify_device_map_is_true_for_a_multi_device_hf_device_map_only():
    acc = _acc()
    model = _model()
    assert acc.verify_device_map(model) is False
    model[0].hf_device_map = {"": "cpu"}
    assert acc.verify_device_map(model) is False
    model[0].hf_device_map = {"0": 0, "2": "cpu"}
    assert acc.verify_device_map(model) is True


def test_autocast_handler_enabled_maps_onto_enabled():
    from accelerate.utils import AutocastKwargs

    acc = _acc(mixed_precision="bf16")
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=True, cache_enabled=True)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with acc.autocast(AutocastKwargs(enabled=True), enabled=False):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(TypeError, match=r"autocast\(False\).*write autocast\(enabled=False\)"):
        acc.autocast(False)
    with pytest.raises(TypeError, match=r"autocast_handler=\{\}\) needs Accelerate's AutocastKwargs"):
        acc.autocast({})


def test_load_state_load_kwargs_and_map_location(tmp_path):
    acc = _acc()
    model = acc.prepare(_model())
    acc.save_state(str(tmp_path / "ck"))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(str(tmp_path / "ck"), load_kwargs={"weights_only": True}, map_location="cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    acc.load_state(str(tmp_path / "ck"), {}, map_location="on_device")
    with pytest.raises(NotImplementedError, match=r"load_kwargs=\{'weights_only': False\}\).*add_safe_globals"):
        acc.load_state(str(tmp_path / "ck"), load_kwargs={"weights_only": False})
    with pytest.raises(NotImplementedError, match=r"load_state\(map_location='cuda:3'\).*drop map_location="):
        acc.load_state(str(tmp_path / "ck"), map_location="cuda:3")
    with pytest.raises(NotImplementedError, match=r"load_state\(strict=False\)"):
        acc.load_state(str(tmp_path / "ck"), strict=False)


def test_slice_fn_for_dispatch_cuts_each_ranks_piece():
    from mixprec.data.dispatch import DispatchedLoader

    loader = torch.utils.data.DataLoader(torch.arange(12), batch_size=6)
    calls = []

    def every_other(batch, data_slice, process_index, num_processes):
        calls.append((data_slice, process_index, num_processes))
        return batch[data_slice][::2]

    kw = {"rank": 0, "world_size": 3, "group": None, "split_batches": False, "even_batches": True}
    batch = torch.arange(10)
    default = DispatchedLoader(loader, **kw)._pieces(batch, 10, batch)
    assert [p.tolist() for p in default] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    custom = DispatchedLoader(loader, slice_fn=every_other, **kw)._pieces(batch, 10, batch)
    assert [p.tolist() for p in custom] == [[0, 2], [4, 6], [8, 0]]
    assert calls == [(slice(0, 4), 0, 3), (slice(4, 8), 1, 3), (slice(8, 12), 2, 3)]
    # One process: the loader is not dispatched and the function is not called, as in Accelerate.
    acc = _acc()
    dl = acc.prepare_data_loader(loader, slice_fn_for_dispatch=every_other)
    assert [b.tolist() for b in dl] == [list(range(6)), list(range(6, 12))] and len(calls) == 3
    with pytest.raises(TypeError, match=r"slice_fn_for_dispatch=3\) needs a callable"):
        acc.prepare_data_loader(loader, slice_fn_for_dispatch=3)


def test_profile_yields_a_profiler_and_writes_the_handlers_trace(tmp_path):
    from accelerate.utils import ProfileKwargs

    acc = _acc()
    with acc.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in e.key for e in prof.key_averages())
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path / "trace"))
    with acc.profile(handler) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert (tmp_path / "trace" / "profile_0.json").stat().st_size > 0
    with pytest.raises(TypeError, match=r"profile\(profile_handler='cpu'\) needs Accelerate's ProfileKwargs"), \
            acc.profile("cpu"):
        pass


def test_maybe_context_parallel_is_a_no_op_without_buffers_and_refuses_them():
    acc = _acc()
    x = torch.arange(6).reshape(1, 6)
    with acc.maybe_context_parallel():
        y = x * 2
    with acc.maybe_context_parallel(buffers=[], buffer_seq_dims=[]):
        pass
    assert y.shape == (1, 6)
    refused = r"maybe_context_parallel\(buffers=<1 item\(s\)>\).*sequence_parallel"
    with pytest.raises(NotImplementedError, match=refused), \
            acc.maybe_context_parallel(buffers=[x], buffer_seq_dims=[1]):
        pass
    with pytest.raises(NotImplementedError, match=r"no_restore_buffers=<1 item"), \
            acc.maybe_context_parallel(no_restore_buffers={x}):
        pass


def test_new_properties_follow_accelerates_definitions(tmp_path):
    from mixprec import ProjectConfiguration

    acc = _acc(project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    assert (acc.project_dir, acc.logging_dir, acc.save_iteration, acc.multi_device, acc.tensor_parallel_rank) == (
        str(tmp_path), str(tmp_path), 0, False, 0)
    assert _acc().logging_dir is None
    acc.prepare(_model())
    acc.save_state()
    assert acc.save_iteration == 1
    with pytest.raises(NotImplementedError, match="context parallelism is not supported"):
        acc.context_parallel_rank  # noqa: B018
    with pytest.raises(NotImplementedError, match="pipeline parallelism is not supported"):
        acc.pipeline_parallel_rank  # noqa: B018


def _dispatch_with_slice_fn(state):
    """2 ranks, dispatch_batches=True: rank 0 reads, each rank gets what the function cut."""
    import torch
    from torch.utils.data import DataLoader

    from mixprec import Accelerator, DataLoaderConfiguration

    def reversed_piece(batch, data_slice, process_index, num_processes):
        assert num_processes == 2
        return batch[data_slice].flip(0) + 100 * process_index

    acc = Accelerator(cpu=True, log_policy=False, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare_data_loader(DataLoader(torch.arange(16), batch_size=4), slice_fn_for_dispatch=reversed_piece)
    return [b.tolist() for b in loader]


def test_slice_fn_for_dispatch_on_two_processes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))  # as tests/test_gpu_check.py
    from harness import run_distributed

    r0, r1 = run_distributed(_dispatch_with_slice_fn, 2, timeout=120)
    # Global batches of 8 (4 per rank): each rank's piece, as the function cut it.
    assert r0 == [[3, 2, 1, 0], [11, 10, 9, 8]]
    assert r1 == [[107, 106, 105, 104], [115, 114, 113, 112]]
