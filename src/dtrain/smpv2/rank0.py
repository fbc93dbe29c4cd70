"""``load_state_dict_from_rank0``: the tp group of rank 0 takes the weights rank 0's model had
before it was transformed (a pretrained model, loaded on rank 0 alone), each rank its part.

Rank 0 keeps its model's tensors whole before they are split; once split, every tensor is sent
to the ranks of its tp group as torch's ``distribute_tensor`` sends a whole tensor from the
group's first rank: a split one scattered (each rank receives its part only), a replicated one
broadcast. The other ranks' models may be on the meta device: they
get real tensors. Other tp groups keep what they have; FSDP's ``sync_module_states`` copies the
first tp group's weights to them, as SMP documents.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from dtrain.modelparallel.deferred import swap_in


def named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``model``'s parameters and buffers, each once, in an order every rank agrees on."""
    return [*model.named_parameters(), *model.named_buffers()]


def load_from_rank0(model: nn.Module, whole: dict[str, Tensor] | None, mesh: DeviceMesh) -> None:
    """Give the ranks of ``mesh`` (a tp mesh holding rank 0, where ``whole`` holds rank 0's
    :func:`named_tensors` from before the split) their parts of rank 0's tensors, in place."""
    device = torch.device(mesh.device_type)
    for name, tensor in named_tensors(model):
        placements = tensor.placements if isinstance(tensor, DTensor) else (Replicate(),)
        if whole is not None:  # each whole tensor let go once sent
            source = whole.pop(name).detach().to(device)
        else:  # shaped as the whole tensor, no memory: only the part received is allocated
            source = torch.empty((), dtype=tensor.dtype, device=device).expand(tensor.shape)
        received = distribute_tensor(source, mesh, placements, src_data_rank=0)
        value = received if isinstance(tensor, DTensor) else received.to_local()
        swap_in(tensor, value.detach())


def holds_rank0(mesh: DeviceMesh) -> bool:
    """Whether rank 0 is one of ``mesh``'s ranks."""
    return 0 in dist.get_process_group_ranks(mesh.get_group())
