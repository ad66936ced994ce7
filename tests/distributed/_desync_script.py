"""One fault of tests/distributed/test_desync.py, run on every rank of a 2-process job
(started by the test with RANK/WORLD_SIZE/MASTER_* set, or by `mixprec launch`).

Usage: python _desync_script.py CASE TIMEOUT_S

Prints "RESULT rank=<r> kind=<error|none> elapsed=<s>" then the error message, then
"END". Lines the tests look for carry a "# MARK:<name>" comment.
"""

import datetime
import sys
import time

import torch

from mixprec import Accelerator, CollectiveDesyncError

case, timeout = sys.argv[1], float(sys.argv[2])
backend = {"state_dict": "zero2", "clip": "zero3", "sp_clip": "zero3"}.get(case, "ddp")
# stuck_gloo: the process group's own timeout is the short one (desync detection at 60 s).
short_pg = case == "stuck_gloo"
config = {"collective_timeout": 60 if short_pg else timeout}
if case == "tp_clip":  # tensor parallelism: the first Linear column-split, the last row-split
    config["tensor_parallel"] = {"size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": ["^0$"], "partition_type": "column"}, {"patterns": ["^2$"], "partition_type": "row"}]}}
if case == "sp_clip":  # sequence parallelism: the forward runs Ulysses all-to-alls on the SP group
    config["sequence_parallel"] = {"size": 2}
# state_dict: zero2 with bf16-stored parameters, where get_state_dict gathers the fp32 masters
# (with fp32-stored ones, as on ddp, one rank may call it alone: the parameters are the masters).
acc = Accelerator(cpu=True, log_policy=False, backend=backend,
                  config=config,
                  **({"mixed_precision": "bf16", "param_dtype": torch.bfloat16} if case == "state_dict" else {}),
                  even_batches=False if case.startswith("uneven") else None,
                  timeout=datetime.timedelta(seconds=timeout if short_pg else 1800))
rank = acc.process_index
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
if case == "sp_clip":
    class Attention(torch.nn.Module):  # x [s, 8]: one sequence's slice, 2 heads of 4
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 4)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(a.transpose(1, 2).reshape(-1, 8))

    model = Attention()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
# Under SP each rank holds its own slice of the sequence (the same values on every rank of an
# SP group are refused as an unsliced sequence, src/mixprec/parallel/sequence/ulysses.py);
# under TP every rank of the group gets the same data (checked too).
offset = rank if case == "sp_clip" else 0


def step():
    loss = model(torch.randn(4, 8) + offset).pow(2).mean()
    acc.backward(loss)  # MARK:backward
    opt.step()  # MARK:step
    opt.zero_grad()


step()
start = time.monotonic()
print(f"FAULT_AT {time.time():.3f}", flush=True)  # the tests time detection from here


def report(kind, msg=""):
    print(f"RESULT rank={rank} kind={kind} elapsed={time.monotonic() - start:.2f}\n{msg}\nEND", flush=True)


try:
    if case == "state_dict":
        if rank == 0:
            acc.get_state_dict(model)  # MARK:state_dict
        step()
    elif case == "gather":
        if rank == 0:
            acc.gather(torch.ones(3))  # MARK:gather
        step()
    elif case == "wait":
        if rank == 0:
            acc.wait_for_everyone()  # MARK:wait
        step()
    elif case in ("clip", "tp_clip", "sp_clip"):
        acc.backward(model(torch.randn(4, 8) + offset).pow(2).mean())
        if rank == 0:
            acc.clip_grad_norm_(model.parameters(), 1.0)  # MARK:clip
        opt.step()  # MARK:clip_step
    elif case == "different":
        if rank == 0:
            acc.gather(torch.ones(3))  # MARK:diff0
        else:
            acc.reduce(torch.ones(3))  # MARK:diff1
    elif case in ("stuck", "stuck_gloo"):
        if rank == 1:
            while True:
                time.sleep(0.05)  # MARK:stuck
        step()
    elif case == "reduce":
        if rank == 0:
            acc.reduce(torch.ones(3))  # MARK:reduce
        step()
    elif case == "reduce_late":
        if rank == 0:
            # Rank 1's watchdog times out first: its verdict is published while rank 0's main
            # thread still waits in the store check, which must raise it (not the thread).
            time.sleep(0.4 * timeout)
            acc.reduce(torch.ones(3))  # MARK:reduce_late
        step()
    elif case == "shapes":
        acc.gather(torch.ones(4 + rank, 3))  # MARK:shapes
    elif case.startswith("uneven"):
        data = torch.utils.data.TensorDataset(torch.randn(5, 8))
        loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=1))
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            acc.backward(loss)  # MARK:uneven_backward
            opt.step()
            opt.zero_grad()
        if case == "uneven_wait":
            acc.wait_for_everyone()  # MARK:uneven_wait
    elif case == "main_first":
        with acc.main_process_first():  # MARK:main_first
            if rank == 0:
                time.sleep(2.5 * timeout)  # longer than the timeout: legitimate
        step()
        print(f"main_first ok rank={rank}", flush=True)
    elif case == "slow_step":
        x = torch.randn(4, 8, requires_grad=True)
        out = model(x)
        out.register_hook(lambda g: time.sleep(2 * timeout) or g)  # slow on every rank
        acc.backward(out.pow(2).mean())
        opt.step()
        print(f"slow_step ok rank={rank}", flush=True)
    else:
        raise SystemExit(f"unknown case {case!r}")
except CollectiveDesyncError as e:
    report("error", str(e))
    sys.exit(3)
report("none")
acc.end_training()
