"""An attempt's rendezvous store (torch's ``TCPStore`` server), hosted by ``algo-1``'s agent.

Its port is bound at once, without torch, so the controller can start the ranks right away:
they import torch meanwhile, and a rank that connects before the server runs waits in the
port's listen queue. The server itself starts in a thread once torch has loaded (an agent does
not import torch otherwise); importing torch was the longest step before a job's ranks started.
"""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

from dtrain.errors import DtrainError

BACKLOG = 1024
"""Connections that may wait for the server: every rank of a large job at once."""
CLIENT_TIMEOUT = datetime.timedelta(minutes=30)


class RendezvousStore:
    """A store on ``address`` and a fresh port, until :meth:`close`; it admits whoever reaches
    the port (see ``docs/clusters.md``)."""

    def __init__(self, address: str) -> None:
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        self._listener.bind((address, 0))
        self._listener.listen(BACKLOG)
        self.address = address
        self.port: int = self._listener.getsockname()[1]
        self._server: Any = None
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._start, name="rendezvous-store", daemon=True).start()

    def _start(self) -> None:
        try:
            import torch.distributed as dist

            with self._lock:  # a close waits for a server being made, not for torch to load
                if self._closed:
                    return
                self._server = dist.TCPStore(
                    self.address,
                    self.port,
                    None,
                    True,
                    CLIENT_TIMEOUT,
                    wait_for_workers=False,
                    master_listen_fd=self._listener.detach(),
                )
        except Exception as error:  # reported by check(): the ranks would wait for nothing
            self._error = error

    def check(self) -> None:
        """Raise if the server could not start."""
        if self._error is not None:
            raise DtrainError(f"cannot host the rendezvous store: {self._error}")

    def close(self) -> None:
        """End the server, or keep it from starting, and free the port."""
        with self._lock:
            self._closed = True
            self._server = None  # torch's server stops with its last reference
            self._listener.close()  # if the server has not taken it
