"""Type stub for the private compiled core. Import through ``mixprec`` only."""

from typing import Optional

import torch
from torch import Tensor

def build_info() -> dict[str, object]: ...

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
    step: float,
    decoupled: bool,
    maximize: bool,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None: ...
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
    ) -> None: ...

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
