"""CPU tests of the CUDA-side logic behind gpu-check (issue 23, G2/G3/G6/G8/G10): which copies
count as host reads (src/mixprec/diagnostics/syncs.py), which stream a lazy step result's
event goes on (src/mixprec/step.py), which CUDA device a rank gets
(src/mixprec/distributed/state.py), on which device re-made parameter storage is allocated
(csrc/engines/sharded/core.h, set_storage_bytes: a fake two-device guard), and, on a GPU
only, that the per-step multi-tensor ops call torch's foreach ops (G6). CUDA itself is faked
with monkeypatching; the real thing runs in tests/kernels/test_kernels_cuda.py, the `cuda`
tests here and benchmarks/gpu_check.py on a GPU (`make gpu-check` runs `pytest -m cuda`)."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import _C
from mixprec.diagnostics import syncs
from mixprec.diagnostics.syncs import ScalarReads, classify_copy, copy_is_host_read

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


class FakeTensor:
    """Stands in for a tensor in the copy classification: a device and pinnedness."""

    def __init__(self, device, pinned=False):
        self.device = torch.device(device)
        self._pinned = pinned

    def is_pinned(self):
        return self._pinned


# ---- G2: what counts as a host read --------------------------------------------------

def test_rule_counts_device_to_host_copies_except_non_blocking_into_pinned():
    assert copy_is_host_read(CUDA, CPU, non_blocking=False, dst_pinned=False)
    assert copy_is_host_read(CUDA, CPU, non_blocking=False, dst_pinned=True)  # blocking: waits
    assert copy_is_host_read(CUDA, CPU, non_blocking=True, dst_pinned=False)  # pageable: waits
    assert not copy_is_host_read(CUDA, CPU, non_blocking=True, dst_pinned=True)
    assert not copy_is_host_read(CPU, CUDA, non_blocking=False, dst_pinned=False)  # upload
    assert not copy_is_host_read(CPU, CPU, non_blocking=False, dst_pinned=False)
    assert not copy_is_host_read(torch.device("meta"), CPU, non_blocking=False, dst_pinned=False)
    assert not copy_is_host_read(None, CPU, non_blocking=False, dst_pinned=False)


def test_copy_calls_are_classified_from_their_arguments():
    pinned, pageable, dev = FakeTensor("cpu", True), FakeTensor("cpu", False), FakeTensor("cuda:0")
    # dst.copy_(src, non_blocking): StepResult's snapshot (src/mixprec/step.py) is not a read
    assert classify_copy("aten::copy_", (pinned, dev, True), {}) is None
    assert classify_copy("aten::copy_", (pinned, dev), {"non_blocking": True}) is None
    assert classify_copy("aten::copy_", (pinned, dev, False), {}) == "aten::copy_ (cuda->cpu)"
    assert classify_copy("aten::copy_", (pageable, dev, True), {}) == "aten::copy_ (cuda->cpu)"
    assert classify_copy("aten::copy_", (dev, pageable, False), {}) is None
    # src.to("cpu", non_blocking=..., pin_memory=...)
    assert classify_copy("aten::_to_copy", (dev,), {"device": CPU}) == "aten::_to_copy (cuda->cpu)"
    assert classify_copy("aten::_to_copy", (dev,), {"device": CPU, "non_blocking": True}) == \
        "aten::_to_copy (cuda->cpu)"
    assert classify_copy("aten::_to_copy", (dev,), {"device": CPU, "non_blocking": True,
                                                    "pin_memory": True}) is None
    assert classify_copy("aten::_to_copy", (dev,), {"dtype": torch.float16}) is None  # stays on cuda
    assert classify_copy("aten::add_", (dev, dev), {}) is None


def test_scalar_reads_still_counts_real_reads_and_routes_copies_through_the_rule(monkeypatch):
    seen = []
    real = syncs.classify_copy

    def spy(name, args, kwargs):
        seen.append(name)
        return real(name, args, kwargs)

    monkeypatch.setattr(syncs, "classify_copy", spy)
    t = torch.arange(4.0)
    with ScalarReads() as reads:
        t.sum().item()
        bool(t[0] == 0)
        host = torch.empty(4)
        host.copy_(t, non_blocking=True)  # CPU -> CPU: no read
        t.to(torch.float16)
    assert reads.by_op["aten::_local_scalar_dense"] == 2, dict(reads.by_op)
    assert reads.count == 2
    assert "aten::copy_" in seen and "aten::_to_copy" in seen


# ---- G10: the lazy step result's event goes on the tensors' device's stream ------------

class _FakeCuda:
    """Records what DeviceScalars asks of torch.cuda."""

    def __init__(self):
        self.current_device = 0
        self.guards, self.recorded_on, self.copies = [], [], []

    def install(self, monkeypatch):
        fake = self

        @contextlib.contextmanager
        def device(d):
            fake.guards.append(torch.device(d))
            previous, fake.current_device = fake.current_device, torch.device(d).index
            try:
                yield
            finally:
                fake.current_device = previous

        class Event:
            def record(self, stream=None):
                fake.recorded_on.append(stream if stream is not None else ("stream", fake.current_device))

            def query(self):
                return True

            def synchronize(self):
                pass

        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda d=None: ("stream", torch.device(d).index if d is not None else fake.current_device))
        real_empty = torch.empty

        def empty(*shape, pin_memory=False, **kw):
            t = real_empty(*shape, **kw)
            if pin_memory:
                fake.copies.append(fake.current_device)
            return t

        monkeypatch.setattr(torch, "empty", empty)


class _OnDevice:
    """A 1-element value that says it lives on ``device`` (DeviceScalars reads .device,
    .shape, .dtype and copies it with detach())."""

    def __init__(self, value, device):
        self.value, self.device = torch.tensor([value]), torch.device(device)
        self.shape, self.dtype = self.value.shape, self.value.dtype

    def detach(self):
        return self.value


def test_device_scalars_record_on_the_stream_of_the_tensors_device(monkeypatch):
    from mixprec.step import DeviceScalars, StepResult

    fake = _FakeCuda()
    fake.install(monkeypatch)
    values = DeviceScalars({"found_inf": _OnDevice(0.0, "cuda:1"), "loss_scale": _OnDevice(512.0, "cuda:1"),
                            "grad_norm": None})
    assert fake.current_device == 0  # the host thread's current device: not the tensors'
    assert fake.recorded_on == [("stream", 1)]
    assert fake.guards == [torch.device("cuda", 1)] and fake.copies == [1, 1]
    result = StepResult.deferred(values, "overflow")
    assert not result.immediate() and result.ready()
    assert result.as_dict() == {"stepped": True, "reason": "ok", "loss_scale": 512.0, "grad_norm": None}


def test_device_scalars_refuse_values_on_two_devices(monkeypatch):
    from mixprec.step import DeviceScalars

    _FakeCuda().install(monkeypatch)
    with pytest.raises(ValueError, match=r"'loss_scale' is on cuda:0 but the other values are on cuda:1"):
        DeviceScalars({"found_inf": _OnDevice(0.0, "cuda:1"), "loss_scale": _OnDevice(1.0, "cuda:0")})


# ---- G3: which CUDA device a rank gets ------------------------------------------------

@pytest.fixture
def fake_two_ranks_one_gpu(monkeypatch):
    """Rank 1 of 2 on a machine with one CUDA device; set_device and group creation recorded."""
    from mixprec.distributed import state as st

    calls = {"set_device": [], "init": []}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(torch.device(d)))
    group = {"initialized": False, "backend": None}

    def init_process_group(**kw):
        calls["init"].append(kw)
        group.update(initialized=True, backend=kw["backend"])

    monkeypatch.setattr(st.dist, "is_initialized", lambda: group["initialized"])
    monkeypatch.setattr(st.dist, "get_backend", lambda *a: group["backend"])
    monkeypatch.setattr(st.dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(st.dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(st.dist, "init_process_group", init_process_group)
    # No rendezvous either: rank 1 alone would wait for a store at MASTER_PORT.
    monkeypatch.setattr(st, "_fresh_store", lambda rank, world_size, timeout: ("store", rank, world_size))
    return st, calls, group


def test_nccl_rank_beyond_the_devices_is_refused_naming_local_rank_and_count(fake_two_ranks_one_gpu):
    st, calls, _ = fake_two_ranks_one_gpu
    with pytest.raises(ValueError) as info:
        st.init_distributed(torch.device("cuda"))
    message = str(info.value)
    assert "LOCAL_RANK=1" in message and "torch.cuda.device_count()=1" in message
    assert "--nproc-per-node 1" in message and "backend='gloo'" in message
    assert calls == {"set_device": [], "init": []}  # refused before any CUDA call


def test_gloo_ranks_share_the_device(fake_two_ranks_one_gpu):
    st, calls, _ = fake_two_ranks_one_gpu
    state = st.init_distributed(torch.device("cuda"), backend="gloo")
    assert state.device == torch.device("cuda", 0) and state.backend == "gloo"
    assert calls["set_device"] == [torch.device("cuda", 0)]
    assert calls["init"][0]["backend"] == "gloo" and calls["init"][0]["device_id"] is None
    assert calls["init"][0]["store"] == ("store", 1, 2)  # [Note: a fresh store prefix per process group]


def test_an_existing_gloo_group_lets_ranks_share_the_device(fake_two_ranks_one_gpu):
    st, calls, group = fake_two_ranks_one_gpu
    group.update(initialized=True, backend="gloo")  # the test harness's group (spawn.py)
    state = st.init_distributed(torch.device("cuda"))
    assert state.device == torch.device("cuda", 0) and state.backend == "gloo"
    assert calls["init"] == []


def test_explicit_device_index_beyond_the_count_and_bad_backends_are_refused(fake_two_ranks_one_gpu):
    st, _, group = fake_two_ranks_one_gpu
    with pytest.raises(ValueError, match=r"device=cuda:3 .* 1 CUDA device\(s\).*index below 1"):
        st.init_distributed(torch.device("cuda", 3), backend="gloo")
    with pytest.raises(ValueError, match=r"backend='mpi' is not supported"):
        st.init_distributed(torch.device("cuda"), backend="mpi")
    with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA tensors"):
        st.init_distributed(torch.device("cpu"), backend="nccl")
    group.update(initialized=True, backend="gloo")
    with pytest.raises(ValueError, match=r"already uses 'gloo'; pass backend='gloo'"):
        st.init_distributed(torch.device("cuda"), backend="nccl")


def test_rank_within_the_devices_keeps_its_own_device(fake_two_ranks_one_gpu, monkeypatch):
    st, calls, _ = fake_two_ranks_one_gpu
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    state = st.init_distributed(torch.device("cuda"))
    assert state.device == torch.device("cuda", 1) and state.backend == "nccl"
    assert calls["init"][0]["device_id"] == torch.device("cuda", 1)


# ---- G8: re-made parameter storage is allocated on the parameter's device ---------------

@pytest.mark.parametrize("index", [1, 7])
def test_re_made_parameter_storage_is_allocated_on_the_parameters_device(index):
    """unshard/reshard re-make the flat parameter buffers' storage with set_storage_bytes. A
    device allocator (CUDA's caching allocator) allocates on the *current* device, so the
    function must make the tensor's device current first and restore it after. Run on a fake
    device type (PrivateUse1 with c10's FakeGuardImpl; current index 0) with an allocator
    that records the current index: without the guard it allocated with index 0 current."""
    probe = _C._probe_storage_allocation_device(index)
    assert probe == {"tensor_index": index, "current_before": 0, "allocated_on": index, "current_after": 0}


def test_storage_probe_refuses_an_index_that_shows_nothing():
    with pytest.raises(ValueError, match=r"index must be in \[1, 8\), got 0 \(the fake device's current index is 0"):
        _C._probe_storage_allocation_device(0)
    assert _C._probe_storage_allocation_device(2)["allocated_on"] == 2  # the fake guard was unregistered


# ---- G6: on CUDA the per-step multi-tensor ops are torch's foreach ops ------------------

class _AtenCalls(TorchDispatchMode):
    """The aten ops dispatched in the block, from Python or from mixprec's C++."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, prefix):
        return sum(op.startswith(prefix) for op in self.ops)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_unscale_norm_and_copies_call_torchs_foreach_ops():
    """G6: unscale_and_check_, l2_norm, copy_cast_ and the flat copies run every step; their
    own CUDA kernels reached 15-20% of HBM bandwidth, so on CUDA they call torch's multi-tensor
    ops, one call per dtype (group) in the list (ops.cpp, [Note: torch's foreach ops on CUDA]).
    The old kernels dispatched no aten op at all. Results: tests/kernels/test_kernels_cuda.py."""
    from mixprec import kernels as K

    f32 = [torch.randn(n, device="cuda") for n in (7, 4099, 65537)]
    low = [torch.randn(n, device="cuda").bfloat16() for n in (5, 300)]
    found = torch.zeros(1, device="cuda")
    ref = [t.clone() for t in f32 + low]
    with _AtenCalls() as calls:
        K.unscale_and_check_(f32 + low, found, torch.full((1,), 0.5, device="cuda"))
    # fp32 through torch's op; bf16, which torch's CUDA op refuses ("not implemented for
    # 'BFloat16'", torch 2.11 on an H200), through its arithmetic (ops.cpp)
    assert calls.count("aten._amp_foreach_non_finite_check_and_unscale_") == 1, calls.ops
    assert found.item() == 0.0
    assert all(torch.equal(t, (r.float() * 0.5).to(r.dtype)) for t, r in zip(f32 + low, ref))
    with _AtenCalls() as calls:
        norm = K.l2_norm(f32 + low)
    assert calls.count("aten._foreach_norm") == 2, calls.ops
    ref = torch.linalg.vector_norm(torch.cat([t.float() for t in f32 + low]))
    torch.testing.assert_close(norm, ref, rtol=1e-5, atol=0)
    dsts = [torch.empty_like(t, dtype=torch.bfloat16) for t in f32]
    with _AtenCalls() as calls:
        K.copy_cast_(dsts, f32)
    assert calls.count("aten._foreach_copy_") == 1, calls.ops
    assert all(torch.equal(d, s.bfloat16()) for d, s in zip(dsts, f32))
    flat = torch.empty(sum(t.numel() for t in f32), device="cuda")
    with _AtenCalls() as calls:
        K.flat_copy_in_(flat, f32)
    assert calls.count("aten._foreach_copy_") == 1, calls.ops
    assert torch.equal(flat, torch.cat(f32))
