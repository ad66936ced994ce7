"""CPU tests of the CUDA-side logic behind gpu-check (issue 23, G2/G3/G10): which copies
count as host reads (src/mixprec/diagnostics/syncs.py), which stream a lazy step result's
event goes on (src/mixprec/step.py), and which CUDA device a rank gets
(src/mixprec/distributed/state.py). CUDA itself is faked with monkeypatching; the real
thing runs in tests/kernels/test_kernels_cuda.py and benchmarks/gpu_check.py on a GPU."""

import contextlib

import pytest
import torch

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
