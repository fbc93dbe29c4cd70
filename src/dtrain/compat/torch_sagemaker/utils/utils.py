"""``torch.sagemaker.utils.utils``: see :mod:`dtrain.smpv2.utils`."""

from dtrain.smpv2.utils import timeit

__all__ = ["timeit"]
