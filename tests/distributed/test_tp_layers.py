"""The split layers and their collectives against whole ``nn.Linear``/``nn.Embedding``
(issue #25 item 3), 2 processes over Gloo, one pass of the ranks for every case.

Each case builds the whole module(s) on every rank from one seed, splits a copy with
parallel/tensor/layers.py, runs the same input forward and backward through both, and
compares: the output, the input's gradient, and each rank's slice of every weight
gradient. fp32; a row split sums two partial dot products where the whole layer sums one,
an input gradient under a column split likewise sums the ranks' parts, and a matrix of
another shape takes another blocking in the CPU's GEMM: the bound is 1e-6 relative to the
largest value (fp32 rounding of a few dozen terms). The embeddings copy rows and must agree
bitwise."""

from harness import run_distributed


def _cases(state):
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec.parallel.tensor.layers import TPGroup, local_slice, split_module
    from mixprec.parallel.tensor.plan import LayerPlan

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = TPGroup(dist.group.WORLD, world, rank)
    out = {}

    def rel(a, b):
        a, b = a.detach(), b.detach()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    # A column Linear feeding a row Linear (Megatron's MLP), biases on both.
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    split = copy.deepcopy(whole)
    split_module(split[0], LayerPlan("0", "column", "test"), tp)
    split_module(split[2], LayerPlan("2", "row", "test"), tp)
    x = torch.randn(5, 16, requires_grad=True)
    xs = x.detach().clone().requires_grad_(True)
    y, ys = whole(x), split(xs)
    y.square().sum().backward()
    ys.square().sum().backward()
    out["mlp_out"] = rel(ys, y)
    out["mlp_dx"] = rel(xs.grad, x.grad)
    out["mlp_dw0"] = rel(split[0].weight.grad, local_slice(whole[0].weight.grad, 0, tp, None))
    out["mlp_db0"] = rel(split[0].bias.grad, local_slice(whole[0].bias.grad, 0, tp, None))
    out["mlp_dw2"] = rel(split[2].weight.grad, local_slice(whole[2].weight.grad, 1, tp, None))
    out["mlp_db2"] = rel(split[2].bias.grad, whole[2].bias.grad)
    out["still_linear"] = isinstance(split[0], nn.Linear) and list(split.state_dict()) == list(whole.state_dict())

    # column_gather (an lm_head) and row_split_input, alone.
    for style, dim in (("column_gather", 0), ("row_split_input", 1)):
        torch.manual_seed(1)
        lin = nn.Linear(12, 6)
        s = copy.deepcopy(lin)
        split_module(s, LayerPlan("l", style, "test"), tp)
        x = torch.randn(3, 4, 12, requires_grad=True)
        xs = x.detach().clone().requires_grad_(True)
        y, ys = lin(x), s(xs)
        (y * torch.arange(6.0)).sum().backward()
        (ys * torch.arange(6.0)).sum().backward()
        out[f"{style}_out"] = rel(ys, y)
        out[f"{style}_dx"] = rel(xs.grad, x.grad)
        out[f"{style}_dw"] = rel(s.weight.grad, local_slice(lin.weight.grad, dim, tp, None))

    # A fused weight of three sub-parameters (q, k, v of sizes 8, 4, 4): each split on its own.
    torch.manual_seed(2)
    lin = nn.Linear(8, 16)
    s = copy.deepcopy(lin)
    split_module(s, LayerPlan("qkv", "column", "test", shape=(8, 4, 4)), tp)
    x = torch.randn(2, 8)
    q, k, v = lin(x).split([8, 4, 4], dim=-1)
    qs, ks, vs = s(x).split([4, 2, 2], dim=-1)
    out["fused_q"] = rel(qs, local_slice(q, 1, tp, None))
    out["fused_k"] = rel(ks, local_slice(k, 1, tp, None))
    out["fused_v"] = rel(vs, local_slice(v, 1, tp, None))

    # Vocab-parallel and hidden-split embeddings (ids on both halves, a padding id).
    for style, dim in (("vocab", 0), ("embedding_col", 1)):
        torch.manual_seed(3)
        emb = nn.Embedding(10, 6, padding_idx=7)
        s = copy.deepcopy(emb)
        split_module(s, LayerPlan("e", style, "test"), tp)
        ids = torch.tensor([[0, 4, 5, 9, 7, 5]])
        y, ys = emb(ids), s(ids)
        (y * torch.arange(6.0)).sum().backward()
        (ys * torch.arange(6.0)).sum().backward()
        out[f"{style}_out"] = torch.equal(ys, y)
        out[f"{style}_dw"] = torch.equal(s.weight.grad, local_slice(emb.weight.grad, dim, tp, None))
    return out


def test_split_layers_match_whole_layers():
    results = run_distributed(_cases, 2)
    for rank, out in enumerate(results):
        for key, value in out.items():
            if isinstance(value, bool):
                assert value, (rank, key)
            else:
                assert value <= 1e-6, (rank, key, value)
