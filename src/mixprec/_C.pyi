"""Type stub for the private compiled core. Import through ``mixprec`` only."""

from typing import Optional

import torch
from torch import Tensor

# Keys: torch_version (str), cuda (bool), cuda_archs (list[str]: CMake CUDA_ARCHITECTURES
# entries the kernels were compiled for, "75-real" SASS, "120-virtual" PTX, "120" both; empty
# without CUDA), cxx11_abi (bool), compiler (str).
def build_info() -> dict[str, object]: ...
def cpu_kernel_capability() -> str: ...

# ---- precision (csrc/precision) -------------------------------------------
class ScalerOptions:
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    def __init__(
        self,
        *,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 0.0,
        max_scale: float = ...,
    ) -> None: ...

class GradScaler:
    def __init__(self, options: ScalerOptions, device: torch.device) -> None: ...
    def scale_loss(self, loss: Tensor) -> Tensor: ...
    def inv_scale(self) -> Tensor: ...
    @property
    def found_inf(self) -> Tensor: ...
    @property
    def scale(self) -> Tensor: ...
    def scale_value(self) -> float: ...
    def update(self, tensor_ops: bool = False) -> None: ...
    def clear_found_inf(self) -> None: ...
    @property
    def options(self) -> ScalerOptions: ...
    def growth_tracker(self) -> int: ...
    def hysteresis_left(self) -> int: ...
    def load(self, scale: float, growth_tracker: int, hysteresis_left: int) -> None: ...

class MasterWeights:
    def __init__(self, params: list[Tensor]) -> None: ...
    @property
    def params(self) -> list[Tensor]: ...
    @property
    def masters(self) -> list[Tensor]: ...
    def fold_grads(self) -> int: ...
    def write_back(self) -> None: ...
    def reload_from_params(self) -> None: ...
    def master_grads(self) -> list[Tensor]: ...

# ---- multi-tensor kernels (csrc/kernels) ----------------------------------
def unscale_and_check_(tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None: ...
def l2_norm(tensors: list[Tensor], found_inf: Optional[Tensor] = None) -> Tensor: ...
def fused_adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    lowp_params: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float = 0.0,
    decoupled: bool,
    maximize: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    steps: list[Tensor] = ...,
) -> None:
    """One Adam/AdamW step; ``step`` is the incremented count, or ``steps`` gives one fp32
    1-element counter per param that the op increments itself unless ``found_inf`` is set
    ([Note: device step counters] in mixprec/kernels.py)."""
def _advance_step_counters_(steps: list[Tensor], found_inf: Optional[Tensor] = None) -> None:
    """Add 1 to each fp32 1-element counter, or 0 when ``found_inf`` (0-dim or [1]) is
    nonzero, on their device: fused_adam_'s counter update on CUDA (for tests)."""
def fused_sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    lowp_params: list[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first_step: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None: ...
def copy_cast_(dsts: list[Tensor], srcs: list[Tensor]) -> None: ...
def scale_copy_and_check_(dsts: list[Tensor], srcs: list[Tensor], found_inf: Tensor, scale: Tensor) -> None:
    """dsts[i] = srcs[i] * scale (same dtypes; in place allowed), setting found_inf to 1.0
    when a source element is inf/nan, in one pass (the ddp Reducer's copy-in)."""
def flat_copy_in_(flat: Tensor, srcs: list[Tensor]) -> None: ...
def flat_copy_out_(dsts: list[Tensor], flat: Tensor) -> None: ...

# ---- communication and engines (csrc/comm, csrc/engines) ------------------
def broadcast_coalesced(tensors: list[Tensor], group_name: str, root: int = 0) -> None: ...

class ReducerOptions:
    def __init__(
        self,
        *,
        bucket_cap_bytes: int = 26214400,
        first_bucket_cap_bytes: int = 1048576,
        reduce_dtype: Optional[torch.dtype] = None,
        find_unused_parameters: bool = False,
        check_nonfinite: bool = False,
    ) -> None:
        """check_nonfinite: the copy into the buckets checks for inf/nan and agrees the
        flag in the last bucket ([Note: non-finite check in the copy-in])."""

class Reducer:
    def __init__(
        self,
        params: list[Tensor],
        targets: list[Tensor],
        names: list[str],
        group_name: str,
        options: ReducerOptions,
    ) -> None: ...
    def set_sync(self, sync: bool) -> None: ...
    @property
    def sync(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    def bucket_indices(self) -> list[list[int]]: ...
    def bytes_reduced_last_backward(self) -> int: ...
    @property
    def checks_nonfinite(self) -> bool:
        """check_nonfinite was asked and every bucket holds its gradients as views."""
    def take_nonfinite_check(self) -> Optional[Tensor]:
        """The agreed inf/nan flag of the last synchronising backward (1 element, the number
        of ranks that saw one), once; None when there is none to take."""

# ---- the step in one call (csrc/engines/step) ------------------------------
class OptimizerPlan:
    """What a fused step reads, gathered once per optimizer ([Note: the step plan] in
    csrc/engines/step/optimizer_plan.h). ``buckets``: tuples ``(group, params, state1,
    state2, steps, lowps)``, None where a param has no state yet."""

    def __init__(self, adam: bool, buckets: list[tuple]) -> None: ...
    @property
    def adam(self) -> bool: ...
    @property
    def num_params(self) -> int: ...
    def grads(self) -> list[Tensor]: ...

class PlanSource:
    """The identities of an optimizer's param lists and state entries when its step plan was
    built ([Note: the plan's sources] in csrc/bindings/step.cpp)."""

    def __init__(self, lists: list, state: dict) -> None: ...
    def current(self) -> bool: ...

def plans_l2_norm(
    plans: list[OptimizerPlan],
    found_inf: Optional[Tensor] = None,
    sources: list[Optional[PlanSource]] = [],
    outsiders: tuple = (),
) -> tuple[int, Optional[Tensor]]:
    """(status, norm): l2_norm over the gradients of every plan's params (None: none holds
    one); status 3: a plan's source changed, 4: an outsider holds a gradient (nothing done)."""

def fused_step(
    adam: list[tuple] = [],
    sgd: list[tuple] = [],
    *,
    plan: Optional[OptimizerPlan] = None,
    options: list[tuple] = [],
    source: Optional[PlanSource] = None,
    found_inf: Optional[Tensor] = None,
    check: bool = False,
    reducers: list[Reducer] = [],
    agree_group: str = "",
    grad_scale: Optional[Tensor] = None,
    gather: list[ShardedCore] = [],
    scaler: Optional[GradScaler] = None,
    update_scaler: bool = False,
    keep_found_inf: Optional[Tensor] = None,
    keep_scale: Optional[Tensor] = None,
) -> int:
    """The post-backward step in one call ([Note: one call per step]): check (and unscale
    by ``scaler``) the gradients unless every Reducer in ``reducers`` has a fresh flag,
    all-reduce MAX ``found_inf`` over ``agree_group``, run the fused updates (gradients
    times ``grad_scale``; skipped on the device when found_inf is set), gather the updated
    shards of ``gather``, update ``scaler`` when ``update_scaler``. Adam groups are tuples
    ``(params, grads, exp_avgs, exp_avg_sqs, lowp_params, steps, lr, beta1, beta2, eps,
    weight_decay, decoupled, maximize)``; SGD groups ``(params, grads, momentum_buffers,
    lowp_params, lr, momentum, dampening, nesterov, weight_decay, maximize, first_step)``.
    With ``plan``, its params holding a gradient join the groups, with ``options`` per param
    group (Adam ``(lr, beta1, beta2, eps, weight_decay, decoupled, maximize)``, SGD ``(lr,
    momentum, dampening, nesterov, weight_decay, maximize)``). Returns 0 when done; 1 (the plan
    declined a param or gradient) or 2 (a param with a gradient has no state yet) when
    nothing was done."""

def merge_nonfinite_checks(reducers: list[Reducer], found_inf: Tensor) -> bool:
    """OR every reducer's fresh agreed inf/nan flag into found_inf ([Note: non-finite check
    in the copy-in]); False, with nothing taken into account, when some reducer has none."""
def finish_reductions(cores: list[ShardedCore]) -> list[bool]:
    """Finish every core's pending reductions, in the given order (the same on every rank);
    which cores hold gradients. The sharded engines' wait, one call for all cores."""

# ---- sharded engines (csrc/engines/sharded) --------------------------------
class ShardOptions:
    def __init__(
        self,
        *,
        stage: int,
        bucket_cap_bytes: int = 26214400,
        first_bucket_cap_bytes: int = 1048576,
        collective: str = "auto",
        group_name: str,
        max_inflight_buckets: int = 2,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None: ...
    @property
    def reduce_dtype(self) -> torch.dtype: ...
    @property
    def reduce_in_backward(self) -> bool: ...
    @property
    def free_grad_buckets(self) -> bool: ...
    @property
    def shard_params(self) -> bool: ...
    @property
    def reshard_after_backward(self) -> bool: ...
    @property
    def max_inflight_buckets(self) -> int: ...
    @property
    def collective(self) -> str: ...

class ShardedCore:
    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        storage_dtypes: list[torch.dtype],
        group_name: str,
        options: ShardOptions,
    ) -> None: ...
    def set_sync(self, sync: bool) -> None: ...
    @property
    def sync(self) -> bool: ...
    def reduce(self) -> None: ...
    def zero_grad(self, release: bool = False) -> None:
        """Drop unreduced gradients; zero the gradient shard, or free its memory (and
        ZeRO-1's full buckets) with ``release`` until the next reduction lands."""
    def grad_shard_bytes(self) -> int: ...
    def ensure_grad_shard(self) -> None: ...
    def has_grads(self) -> bool: ...
    def set_launch_from_hooks(self, on: bool) -> None:
        """False: the hooks only accumulate; the engine launches the reductions with
        ``launch_all`` / ``end_backward`` ([Note: agreed reductions] in core.h)."""
    @property
    def launch_from_hooks(self) -> bool: ...
    def launch_all(self) -> None:
        """Launch every bucket not launched in this backward (zeros where no gradient)."""
    def end_backward(self) -> None:
        """``launch_all`` then complete this core's reductions (end of a syncing backward)."""
    def share_backward_count(self, other: ShardedCore) -> None:
        """Count backward hooks with ``other`` (the cores of one model) for ``reduce``."""
    def gather_params(self) -> None:
        """All-gather the owned masters, rounded to the storage dtype, into the parameters."""
    def unshard(self, async_op: bool = False) -> None: ...
    def wait_unshard(self) -> None: ...
    def reshard(self) -> None: ...
    @property
    def unsharded(self) -> bool: ...
    def param_buffer_bytes(self) -> int: ...
    def full_masters(self) -> list[Tensor]: ...
    def gather_master(self, index: int, dst: int = -1) -> Optional[Tensor]:
        """Parameter ``index``'s full fp32 value, gathered from the master shards: only on group
        rank ``dst`` (None on the others), or on every rank with ``dst=-1``. A collective
        ([Note: one parameter's master, gathered] in csrc/engines/sharded/core.h)."""
    @property
    def params(self) -> list[Tensor]:
        """The model's parameters this core shards, in model order (the same objects)."""
    @property
    def master_shard(self) -> Tensor: ...
    @property
    def grad_shard(self) -> Tensor: ...
    def owned_ranges(self) -> list[tuple[int, int, int, int, int]]: ...
    def partition_map(self) -> dict[str, tuple[int, int, tuple[int, ...]]]: ...
    def bucket_shards(self) -> list[tuple[int, int]]: ...
    def bucket_indices(self) -> list[list[int]]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def shard_numel(self) -> int: ...
    @property
    def padded_numel(self) -> int: ...
    @property
    def param_numel(self) -> int: ...
    def bytes_reduced_last(self) -> int: ...
    def bytes_gathered_last(self) -> int: ...
    def grad_bucket_bytes(self) -> int: ...
    def grad_bucket_peak_bytes(self) -> int: ...
    def reset_grad_bucket_peak(self) -> None: ...
    def inflight_buckets(self) -> int: ...
    def comm_counters(self) -> dict[str, int]: ...
    def reset_comm_counters(self) -> None: ...
