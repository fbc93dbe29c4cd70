"""``smp.amp.GradScaler``: torch's loss scaler, made safe for a model split across ranks.

Each rank holds only its partition's gradients, so an inf/NaN seen by one rank must make every
rank skip the step and back off the scale together, or the replicas' parameters and scales drift
apart. The scaler agrees on the found-inf flag over the whole world (every mp group and every dp
group) before ``step`` and ``update`` read it. Only the pipeline rank that computes the loss calls
``scale(loss)`` (inside ``@smp.step``), so every scaler holds its scale from the start. A
tensor-parallel model's DTensor gradients are checked and unscaled on each rank's part of them.
"""

from __future__ import annotations

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.api.precision import overflowed


class GradScaler(torch.amp.GradScaler):
    """Use like ``torch.amp.GradScaler``: ``scaler.scale(loss)``, ``scaler.step(optimizer)``,
    ``scaler.update()``; every rank must call ``step`` (or ``unscale_``) for each optimizer."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        st = state.current("smp.amp.GradScaler")
        super().__init__(
            st.device.type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._world = st.world_process_group
        if enabled:
            # Only the rank computing the loss calls scale(); the others must hold the same
            # scale from the start, or their step() fails ("_scale is None").
            self._lazy_init_scale_growth_tracker(st.device)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's unscaling, on this rank's part of each gradient (torch's groups a tensor
        parallel model's DTensor gradients with plain ones of the same device and dtype, which
        its kernel refuses), the flag agreed over the world (:func:`.precision.overflowed`):
        one flag, on the scale's device, which ``step`` and ``update`` read."""
        grads = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:  # duplicate indices summed first, as torch's does
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grads.append(grad)
            found_inf.copy_(overflowed(grads, inv_scale, found_inf.device, self._world))
        return {found_inf.device: found_inf}
