"""A stand-in for NVIDIA's Transformer Engine, which is GPU only, serving exactly what AWS's SMP v2
script (``shared-scripts/train_lib.py``) touches with fp8 off: ``import transformer_engine`` and
``from transformer_engine.common.recipe import Format, DelayedScaling``, both at import. Its fp8
paths (``transformer_engine.pytorch``, a recipe made or read) fail naming what they reached.

Kept in dtrain's tests, for runs of AWS's script on CPU: a job puts this folder on its ranks'
``PYTHONPATH`` (``dtrain run --environment PYTHONPATH=tests/smpv2/stand_ins``); on a GPU the
script uses NVIDIA's package.
"""

from typing import NoReturn


class TransformerEngineMissing(ImportError):
    """A part of Transformer Engine that this stand-in does not serve was reached."""


def missing(name: str) -> NoReturn:
    raise TransformerEngineMissing(
        f"{name}: Transformer Engine is NVIDIA's GPU library and this is dtrain's stand-in for "
        "it, serving only the names AWS's SMP v2 script imports with fp8 off; run with --fp8 0, "
        "or on a GPU with transformer_engine installed"
    )


def __getattr__(name: str) -> NoReturn:
    if name.startswith("_"):  # probes (``__version__``, ``__wrapped__``): no such attribute
        raise AttributeError(name)
    missing(f"transformer_engine.{name}")
