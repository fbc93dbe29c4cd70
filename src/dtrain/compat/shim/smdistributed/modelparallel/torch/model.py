"""``smdistributed.modelparallel.torch.model``: where SMP defines ``DistributedModel`` (Hugging
Face's ``Trainer`` checks ``isinstance(model, smp.model.DistributedModel)``)."""

from dtrain.modelparallel.api.model import DistributedModel

__all__ = ["DistributedModel"]
