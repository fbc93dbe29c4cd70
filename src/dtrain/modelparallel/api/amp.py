"""``smp.amp.GradScaler``: torch's loss scaler, made safe for a model split across ranks.

Each rank holds only its partition's gradients, so an inf/NaN seen by one rank must make every
rank skip the step and back off the scale together, or the replicas' parameters and scales drift
apart. The scaler agrees on the found-inf flag over the whole world (every mp group and every dp
group) before ``step`` and ``update`` read it. Only the pipeline rank that computes the loss calls
``scale(loss)`` (inside ``@smp.step``), so every scaler holds its scale from the start.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.modelparallel import state


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
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        seen = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            seen += flag.to(seen.device)
        dist.all_reduce(seen, group=self._world)
        agreed = (seen > 0).float()
        # A rank without gradients still reports the agreed flag (step/update require one).
        per_device = per_device or {found_inf.device: found_inf}
        for flag in per_device.values():
            flag.copy_(agreed.to(flag.device))
        return per_device
