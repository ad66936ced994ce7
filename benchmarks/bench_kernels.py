"""Bandwidth of mixprec's multi-tensor kernels vs memcpy and plain PyTorch (CPU).

A transformer-shaped parameter set (embeddings + [d,4d]/[4d,d]/[d,d] matrices +
biases/norms). For each kernel: GB/s moved and the ratio to memcpy bandwidth
(dst.copy_(src) of a big fp32 buffer) measured in the same run; then the fused
step (one fused_adam_ call: unscale + inf check + AdamW + bf16 write-back) vs
plain PyTorch doing the same work (_amp_foreach_non_finite_check_and_unscale_ +
AdamW(fused=True) + _foreach_copy_ to bf16). A/B runs alternate; medians.

    python benchmarks/bench_kernels.py            # ~50M params
    python benchmarks/bench_kernels.py --quick    # small model, < 30 s

``measure()`` is what benchmarks/run_all.py calls.
"""

from __future__ import annotations


import argparse
import statistics
import time

import torch

from mixprec import kernels as K


def shapes(d, layers, vocab):
    out = [(vocab, d), (2048, d)]  # token + position embeddings
    for _ in range(layers):
        out += [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,),
                (d,), (d,), (d,), (d,)]
    return out + [(d,), (d,)]


def bench(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternate(a, b, repeats):
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def run(quick: bool, repeats: int, threads: int) -> dict:
    """Bandwidths and the fused-step A/B at ``threads`` torch threads (restored on return)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(quick, repeats, threads)
    finally:
        torch.set_num_threads(previous)


def _run(quick: bool, repeats: int, threads: int) -> dict:
    d, layers, vocab = (256, 4, 8000) if quick else (768, 6, 16000)
    shp = shapes(d, layers, vocab)
    params = [torch.randn(s) * 0.02 for s in shp]
    n = sum(p.numel() for p in params)
    grads_bf16 = [torch.randn(s).bfloat16() for s in shp]
    grads32 = [g.float() for g in grads_bf16]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    lowp = [p.bfloat16() for p in params]
    inv, found = torch.tensor([1.0]), torch.zeros(1)
    reps = repeats

    big = torch.empty(max(n, 8 << 20))
    big_dst = torch.empty_like(big)
    t_mem = bench(lambda: big_dst.copy_(big), reps)
    mem_bw = 2 * big.numel() * 4 / t_mem
    out = {"threads": threads, "params": n, "tensors": len(shp), "memcpy_gbps": mem_bw / 1e9, "kernels": {}}

    def record(name, t, nbytes):
        out["kernels"][name] = {"ms": t * 1e3, "gbps": nbytes / t / 1e9, "vs_memcpy": nbytes / t / mem_bw}

    record("unscale_and_check_ (fp32)", bench(lambda: K.unscale_and_check_(grads32, found, inv), reps), 8 * n)
    record("l2_norm (fp32)", bench(lambda: K.l2_norm(grads32), reps), 4 * n)
    record("copy_cast_ fp32->bf16", bench(lambda: K.copy_cast_(lowp, params), reps), 6 * n)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10.0,
              decoupled=True, maximize=False)
    record("fused_adam_ (fp32 grads)",
           bench(lambda: K.fused_adam_(params, grads32, m, v, [], inv_scale=None, found_inf=None, **kw), reps),
           28 * n)
    fused = lambda: K.fused_adam_(params, grads_bf16, m, v, lowp, inv_scale=inv,  # noqa: E731
                                  found_inf=found, **kw)
    # bytes: read bf16 grad 2 + p, m, v 12; write p, m, v 12 + bf16 param 2 = 28 per element
    record("fused step (bf16 grads, +unscale+bf16)", bench(fused, reps), 28 * n)

    # Plain PyTorch doing the same work: unscale the grads, AdamW(fused), cast-copy.
    tparams = [torch.nn.Parameter(p.clone()) for p in params]
    tgrads = [g.clone() for g in grads32]
    for p, g in zip(tparams, tgrads):
        p.grad = g
    opt = torch.optim.AdamW(tparams, lr=1e-4, weight_decay=0.01, fused=True)
    tlowp = [p.detach().bfloat16() for p in tparams]
    tparams_d = [p.detach() for p in tparams]

    def plain():
        torch._amp_foreach_non_finite_check_and_unscale_(tgrads, found, inv)
        opt.step()
        torch._foreach_copy_(tlowp, tparams_d)

    t_fused, t_plain = alternate(fused, plain, reps)
    # Plain's three passes move 42 B per element: unscale r/w fp32 grad 8, AdamW(fused) reads
    # p, g, m, v and writes p, m, v 28, cast-copy reads fp32 and writes bf16 6.
    out.update(fused_step_ms=t_fused * 1e3, plain_step_ms=t_plain * 1e3, speedup=t_plain / t_fused,
               fused_step_gbps=28 * n / t_fused / 1e9, plain_step_gbps=42 * n / t_plain / 1e9)
    return out


def measure(quick: bool = False, repeats: int | None = None, threads: list[int] | None = None) -> list[dict]:
    """One :func:`run` per thread count (default: 1 and all of torch's)."""
    repeats = repeats if repeats is not None else (3 if quick else 7)
    threads = threads or sorted({1, torch.get_num_threads()})
    return [run(quick, repeats, t) for t in threads]


def report(res: dict) -> None:
    print(f"\n== {res['threads']} thread(s), {res['params'] / 1e6:.1f}M params in {res['tensors']} tensors; "
          f"memcpy {res['memcpy_gbps']:.2f} GB/s")
    for name, k in res["kernels"].items():
        print(f"  {name:<40s} {k['ms']:8.2f} ms  {k['gbps']:7.2f} GB/s  {k['vs_memcpy']:5.2f}x memcpy")
    print(f"  fused step {res['fused_step_ms']:.2f} ms vs plain PyTorch {res['plain_step_ms']:.2f} ms: "
          f"speed-up {res['speedup']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repeats (< 30 s)")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    for res in measure(args.quick, args.repeats):
        report(res)


if __name__ == "__main__":
    main()
