"""The names of SMP v2's API that dtrain does not implement yet: they import, and fail when used.

AWS's scripts import most of ``torch.sagemaker`` at the top and use each part only on some paths
(fp8, mixture of experts, asynchronous checkpoints). So every name they import exists, and one
that is not built yet raises :class:`NotAvailableYet` naming itself when called or used, never
returning something that would train differently from SMP.
"""

from __future__ import annotations

from typing import Any, NoReturn


class NotAvailableYet(NotImplementedError):
    """A part of SMP v2's API that dtrain does not implement yet."""


class Unavailable:
    """Stands for the function or class ``name``: calling it, or reading one of its
    attributes (an enum's member), raises :class:`NotAvailableYet`."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self) -> NoReturn:
        raise NotAvailableYet(f"{self._name}: not available yet in dtrain")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._fail()

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # probes by copy, pickle, inspect: no such attribute
            raise AttributeError(attribute)
        self._fail()

    def __repr__(self) -> str:
        return f"<{self._name}: not available yet in dtrain>"
