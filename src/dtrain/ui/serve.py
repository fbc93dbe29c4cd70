"""``dtrain ui``: serve the web view with waitress, on loopback unless told otherwise."""

from __future__ import annotations

import errno
import secrets
import sys
from typing import TextIO

from dtrain.errors import ConfigError
from dtrain.jobs.store import JobStore
from dtrain.secretfile import read_secret_file
from dtrain.ui.app import create_app, is_loopback

MIN_TOKEN_LENGTH = 16


def read_token(token_file: str) -> str:
    """The token in ``token_file`` (``-``: standard input), stripped of surrounding space; a
    file must pass the checks a job's secret file does (:mod:`dtrain.secretfile`)."""
    if token_file == "-":
        text = sys.stdin.read()
    else:
        text = read_secret_file("--token-file", token_file).decode(errors="replace")
    token = text.strip()
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise ConfigError(
            "--token-file",
            token_file,
            f"a file holding one token of {MIN_TOKEN_LENGTH}+ characters",
        )
    return token


def serve(host: str, port: int, token_file: str | None, out: TextIO) -> int:
    """Serve until interrupted. A host other than loopback needs a token: the one in
    ``token_file``, else a new one, printed in the address to open."""
    from waitress.server import MultiSocketServer, create_server

    if not 0 <= port <= 65535:
        raise ConfigError("--port", port, "a port from 1 to 65535 (0: any free port)")
    token = read_token(token_file) if token_file else None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    try:
        server = create_server(
            create_app(JobStore(), token), host=host, port=port, threads=8, ident="dtrain-ui"
        )
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError("--port", port, "a free port (--port 0 picks one)") from None
        raise ConfigError("--host", host, f"an address of this machine ({error})") from None
    # A name of several addresses (localhost: ::1 and 127.0.0.1) gets a socket on each, each
    # with a port of its own where the port is 0.
    if isinstance(server, MultiSocketServer):
        addresses = list(server.effective_listen)
    else:
        addresses = [(host, server.effective_port)]  # type: ignore[attr-defined]  # stubs lack it
    query = f"?token={token}" if token else ""
    for address, bound in addresses:
        shown = f"[{address}]" if ":" in address else address
        print(f"dtrain ui: http://{shown}:{bound}/{query}", file=out, flush=True)
    if not is_loopback(host):
        print(
            "dtrain ui: listening beyond this machine; every request needs the token",
            file=out,
            flush=True,
        )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
