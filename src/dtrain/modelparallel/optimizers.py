"""``smp.optimizers``: SMP's fused optimizers, in plain torch: ``FusedLAMB``.

SMP shipped apex's ``FusedLAMB`` (a CUDA kernel) with its global gradient norm taken over the
whole pipeline; AWS's BERT script trains with it. This one computes the same update with
torch's tensor operations, on any device, and on DTensors (tensor parallelism's and sharded
data parallelism's shards): elementwise work stays on each rank's part, and every norm is the
whole tensor's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.api.precision import clip_gradients
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.dtensors import local, whole


class FusedLAMB(torch.optim.Optimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", Algorithm 2) with apex's ``FusedLAMB`` options, defaults and order of operations.
    Per step, for each parameter ``p`` with gradient ``g``:

    1. ``g`` is divided by ``global_norm / max_grad_norm`` when the global L2 norm of all the
       gradients (the model's, over every pipeline partition) exceeds ``max_grad_norm``;
    2. with ``adam_w_mode=False``, ``g += weight_decay * p`` (L2 regularisation);
    3. Adam's moments: ``m = b1*m + b3*g`` (``b3 = 1 - b1``, or 1 without
       ``grad_averaging``), ``v = b2*v + (1 - b2)*g*g``; ``u = (m/c1) / (sqrt(v/c2) + eps)``
       with ``c = 1 - b**step`` (1 without ``bias_correction``);
    4. with ``adam_w_mode=True``, ``u += weight_decay * p`` (decoupled weight decay);
    5. ``p -= r * u``, the trust ratio ``r = lr * |p| / |u|`` (whole tensors' L2 norms) where the
       group's weight decay is not 0 (or ``use_nvlamb``) and both norms are; else ``r = lr``.

    ``step`` counts per param group, as apex's does. With ``shard_optimizer_state`` (each
    replica stepping its share of the parameters) the global norm would miss the others'
    shares: refused at the first step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Gradients dropped (``set_grad_none``, apex's default) or zeroed."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise RuntimeError("FusedLAMB does not support sparse gradients")
        norm = self._norm_of_gradients(params)
        max_norm = self.defaults["max_grad_norm"]
        clip = norm / max_norm if norm > max_norm else 1.0
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group, clip)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any], clip: float) -> None:
        assert param.grad is not None
        beta1, beta2 = group["betas"]
        decay, step = group["weight_decay"], group["step"]
        moments = self.state[param]
        if not moments:
            moments["exp_avg"] = torch.zeros_like(param)
            moments["exp_avg_sq"] = torch.zeros_like(param)
        grad = param.grad / clip
        if not self.adam_w_mode and decay != 0:
            grad = grad + decay * param
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=beta3)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        first, second = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1, 1)
        update = (exp_avg / first) / ((exp_avg_sq / second).sqrt() + group["eps"])
        if self.adam_w_mode and decay != 0:
            update = update + decay * param
        ratio: torch.Tensor | float = group["lr"]
        if self.use_nvlamb or decay != 0:
            param_norm = whole(torch.linalg.vector_norm(param))
            update_norm = whole(torch.linalg.vector_norm(update))
            trusted = (param_norm != 0) & (update_norm != 0)
            ratio = torch.where(trusted, group["lr"] * param_norm / update_norm, group["lr"])
        local(param).sub_(local(update) * ratio)

    def _norm_of_gradients(self, params: list[torch.Tensor]) -> float:
        """The L2 norm of every gradient of the model: this rank's summed over the pipeline's
        partitions (each holds its own parameters; a DTensor's norm is its whole tensor's);
        every rank calls it, whether it holds gradients or not."""
        device = params[0].device if params else torch.device("cpu")
        group = None
        if state.is_initialized():
            st = state.current("FusedLAMB.step")
            if st.config["shard_optimizer_state"]:
                raise ModelParallelError(
                    "FusedLAMB with shard_optimizer_state: true is not served: each replica "
                    "steps its share of the parameters, and LAMB clips by the global norm of "
                    "all the gradients; turn shard_optimizer_state off (or shard with "
                    "sharded_data_parallel_degree)"
                )
            group = st.pp_process_group if st.pp_size > 1 else None
            device = st.device
        return clip_gradients(params, math.inf, 2.0, group, device)


__all__ = ["FusedLAMB"]
