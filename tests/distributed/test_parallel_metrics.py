"""Metrics and throughput under tensor and sequence parallelism: each sample once.

The ranks of a TP or SP group read the same batches (the loader shards over data-parallel
ranks, src/mixprec/parallel/mesh.py), so an all-gather over the world returns every sample
tp * sp times. ``gather_for_metrics`` keeps one rank per data-parallel rank, the one at this
rank's (sp, tp) place ([Note: metrics over data-parallel ranks] in
src/mixprec/distributed/collectives.py); ``accelerator.progress`` counts items/s over the
data-parallel ranks. Before, TP=2 or SP=2 on 2 processes gathered 10 samples as 20 (18 after
the last batch's remainder cut) and reported twice the items/s.

One pass on 2 warm ranks runs: TP=2, SP=2 and plain ddp (dp=2, the reference), each a prepared
loader of 10 samples in batches of 4 gathered with tensors and with ``use_gather_object``,
a value that differs by rank (under SP: this rank's slice), and the progress multiplier.
"""

from harness import run_distributed

N = 10


def _cases(state):
    import torch

    from mixprec import Accelerator
    from mixprec.progress import Progress

    out = {}
    for name, config in (("tp", {"tensor_parallel": {"size": 2}}), ("sp", {"sequence_parallel": {"size": 2}}),
                         ("ddp", {})):
        acc = Accelerator(cpu=True, log_policy=False, backend="ddp", config=config)
        data = torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32).view(N, 1))
        loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=4 if name != "ddp" else 2))
        tensors, objects = [], []
        for (x,) in loader:
            tensors.append(acc.gather_for_metrics(x))
            objects.extend(acc.gather_for_metrics(x.view(-1).tolist(), use_gather_object=True))
        mine = acc.gather_for_metrics(torch.tensor([[float(acc.process_index)]]))
        tokens = Progress(acc, loader, unit="tokens", bar=False)
        out[name] = {"tensors": torch.cat(tensors).view(-1).tolist(), "objects": objects,
                     "mine": mine.view(-1).tolist(), "world": Progress(acc, loader, bar=False).world,
                     "tokens_world": tokens.world}
        acc.end_training()
    return out


def test_gather_for_metrics_and_progress_count_each_sample_once_under_tp_and_sp():
    results = run_distributed(_cases, 2, timeout=300)
    everything = [float(i) for i in range(N)]
    for rank, res in enumerate(results):
        # plain data parallelism: the reference behaviour (10 samples, each once)
        assert sorted(res["ddp"]["tensors"]) == everything and sorted(res["ddp"]["objects"]) == everything
        assert res["ddp"]["mine"] == [0.0, 1.0] and res["ddp"]["world"] == 2
        for mode in ("tp", "sp"):
            r = res[mode]
            assert r["tensors"] == everything, (mode, rank, r["tensors"])  # old code: each sample twice
            assert r["objects"] == everything, (mode, rank, r["objects"])
            # dp = 1: one rank per data-parallel rank, the one at this rank's place (under SP
            # a per-token value comes back as this rank's slice of every sample)
            assert r["mine"] == [float(rank)], (mode, rank, r["mine"])
            assert r["world"] == 1 and r["tokens_world"] == 1, (mode, r)
