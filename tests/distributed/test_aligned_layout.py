"""Flat buffers keep every parameter 16-byte aligned (issue 23, G7).

The CUDA multi-tensor kernels vectorise a tensor only when it is 16-byte aligned; one shard
segment or bucket view at an odd element offset made the whole tensor scalar. So ZeRO
layouts ([Note: aligned slots] in csrc/engines/sharded/layout.h) and DDP buckets ([Note:
aligned bucket views] in csrc/engines/replicated/reducer.h) start every parameter's slot at
a 16-byte boundary. Checked on 2 ranks with odd-sized parameters: every optimizer segment,
its gradient, every parameter view and every DDP gradient view has data_ptr % 16 == 0; the
padding is zero in every flat buffer after training steps and never part of what the
optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 13*7=91, 7, 35, 5, 15, 3, 3, 3: no size but the first is a multiple of 4 or 8.
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))


def _flat_padding(tensors) -> list[float]:
    """Largest |value| outside the given views, per flat storage they share."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    out = []
    for views in by_storage.values():
        flat = torch.empty(0, dtype=views[0].dtype).set_(views[0].untyped_storage())
        used = torch.zeros(flat.numel(), dtype=torch.bool)
        for v in views:
            used[v.storage_offset():v.storage_offset() + v.numel()] = True
        rest = flat[~used]
        out.append(rest.abs().max().item() if rest.numel() else 0.0)
    return out


def _sharded(backend: str, param_dtype, opts: dict) -> dict:
    from mixprec import Accelerator

    kw = {"param_dtype": param_dtype} if param_dtype is not None else {}
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 1e-4, "bucket_cap_mb": 2e-4, **opts}, **kw)
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    comm = acc.engine.comm
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    misaligned, padding = [], []
    for step in range(3):
        x, y = torch.randn(6, 13, generator=g), torch.randn(6, 3, generator=g)
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 0.5)  # folds: the segments show their gradients
        segments = [s for so in comm.sharded_optimizers.values() for s in so.segments]
        for s in segments:
            if s.master.data_ptr() % 16 or s.master.grad.data_ptr() % 16:
                misaligned.append(("segment", s.offset, s.master.data_ptr() % 16))
        for core in comm.all_cores():
            ranges = [(offset, numel) for _i, _b, offset, _po, numel in core.owned_ranges()]
            for name, buf in (("master", core.master_shard), ("grad", core.grad_shard)):
                used = torch.zeros(buf.numel(), dtype=torch.bool)
                for offset, numel in ranges:
                    used[offset:offset + numel] = True
                rest = buf[~used]
                padding.append((name, rest.abs().max().item() if rest.numel() else 0.0))
        opt.step()
        opt.zero_grad()
    # The optimizer steps exactly the owned elements: no padding in a segment or its state.
    owned = sum(numel for core in comm.all_cores() for *_x, numel in core.owned_ranges())
    stepped = sum(s.numel for so in comm.sharded_optimizers.values() for s in so.segments)
    state_sizes = {v.numel() for so in comm.sharded_optimizers.values() for st in so.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    seg_sizes = {s.numel for so in comm.sharded_optimizers.values() for s in so.segments}
    with (comm.full_params(model) if comm.options.shard_params else _nothing()):
        params = list(model.parameters())
        for n, p in model.named_parameters():
            if p.data_ptr() % 16:
                misaligned.append(("param", n, p.data_ptr() % 16))
        padding.extend(("params", v) for v in _flat_padding(params))
    layouts = [(core.padded_numel, core.param_numel, core.bucket_shards()) for core in comm.all_cores()]
    acc.engine.release()
    return {"misaligned": misaligned, "padding": padding, "owned": owned, "stepped": stepped,
            "state_sizes": state_sizes, "seg_sizes": seg_sizes, "layouts": layouts}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _ddp(mixed_precision: str) -> dict:
    from mixprec import Accelerator

    acc = Accelerator(mixed_precision=mixed_precision, backend="ddp", cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 1e-4, "bucket_cap_mb": 2e-4})
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    misaligned, padding = [], []
    for step in range(3):
        x, y = torch.randn(6, 13, generator=g), torch.randn(6, 3, generator=g)
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        grads = [p.grad for p in model.parameters()]
        misaligned += [(i, gr.data_ptr() % 16) for i, gr in enumerate(grads) if gr.data_ptr() % 16]
        # Views of the buckets: the rest of each bucket (alignment gaps; the last bucket's
        # non-finite flag, 0 here) stays zero through the all-reduce.
        padding += _flat_padding(grads)
        buckets = len({gr.untyped_storage().data_ptr() for gr in grads})
        opt.step()
        opt.zero_grad(set_to_none=False)
    acc.engine.release()
    return {"misaligned": misaligned, "padding": padding, "buckets": buckets}


CONFIGS = [(b, dt, o) for b, o in (("zero1", {}), ("zero2", {}), ("zero3", {"units": ["Linear"]}),
                                   ("fsdp", {"units": ["Linear"]}))
           for dt in (None, "bf16")]


def _all(state):
    out = {}
    for backend, dtype, opts in CONFIGS:
        out[(backend, dtype)] = _sharded(backend, torch.bfloat16 if dtype else None, opts)
    for mp in ("no", "bf16"):
        out[("ddp", mp)] = _ddp(mp)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2, timeout=240)


@pytest.mark.parametrize("backend,dtype", [(b, d) for b, d, _ in CONFIGS])
def test_sharded_segments_and_params_are_16_byte_aligned(results, backend, dtype):
    for rank, res in enumerate(results):
        r = res[(backend, dtype)]
        assert r["misaligned"] == [], (rank, r["misaligned"])
        # Odd sizes really needed padding, and every shard is whole aligned steps (4 fp32).
        assert any(padded > numel for padded, numel, _ in r["layouts"]), r["layouts"]
        for _p, _n, shards in r["layouts"]:
            assert all(offset % 4 == 0 and size % 4 == 0 for offset, size in shards), shards
        assert all(v == 0.0 for _, v in r["padding"]), (rank, r["padding"])
        assert r["stepped"] == r["owned"]
        assert r["state_sizes"] <= r["seg_sizes"], (r["state_sizes"], r["seg_sizes"])


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_ddp_bucket_views_are_16_byte_aligned(results, mixed_precision):
    for rank, res in enumerate(results):
        r = res[("ddp", mixed_precision)]
        assert r["misaligned"] == [], (rank, r["misaligned"])
        assert r["buckets"] > 1  # several buckets, several views each
        assert all(v == 0.0 for v in r["padding"]), (rank, r["padding"])
