"""``transformer_engine.common.recipe``'s two names AWS's script imports; with fp8 off it never
uses them, and using either fails naming it."""

from typing import Any, NoReturn

from transformer_engine import missing


class _Unserved(type):
    """Reading a member of the class (``Format.HYBRID``) fails naming it."""

    def __getattr__(cls, name: str) -> NoReturn:
        if name.startswith("_"):
            raise AttributeError(name)
        missing(f"transformer_engine.common.recipe.{cls.__name__}.{name}")


class Format(metaclass=_Unserved):
    """Transformer Engine's fp8 formats; none is served."""


class DelayedScaling(metaclass=_Unserved):
    """Transformer Engine's fp8 scaling recipe; making one fails naming it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        missing("transformer_engine.common.recipe.DelayedScaling")
