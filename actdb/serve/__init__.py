"""`actdb serve`: the store in a browser. The lens grid to click, a cell's anchors and dims,
positions' paths across layers, and an SQL editor, over the same read-only sandbox as every
query (app.py has the routes, pool.py the queries' limits, guard.py who may ask)."""

from __future__ import annotations

import os
import secrets
import socket
import string
from collections.abc import Callable
from typing import Any

from ..errors import MissingDependencyError, ServeError

LOCAL = ("127.0.0.1", "localhost", "::1")
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~")


def serve(store: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8765,
          query_timeout: float | None = 30.0, max_rows: int = 10_000,
          token: str | None = None, device: str = "auto", connections: int | None = None,
          announce: Callable[[str], object] = print) -> None:
    """Serve the explorer for `store` until interrupted (Ctrl-C).

    Args:
        store: the store to explore (opened read-only; nothing a request sends writes).
        host: the address to listen on; anything but 127.0.0.1, localhost or ::1 needs a
            token, and one is made (and announced) when none is given.
        port: the port (0: any free one; the announced address says which).
        query_timeout: seconds a query may run before it is cancelled (None: no limit).
        max_rows: the most rows an answer carries; it says when more were left out.
        token: the token every request must carry (at least 16 of A-Z a-z 0-9 - . _ ~).
        device: where the tensor functions compute (`auto`, `cpu`, `cuda`, `cuda:i`).
        connections: queries run at once, each on its own connection (default: the cores,
            2 to 8); more requests wait in line.
        announce: called with each line to show the user (the address to open).
    """
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise MissingDependencyError(
            "actdb serve needs starlette and uvicorn, which are not installed: "
            "pip install 'actdb[serve]'") from None
    from .. import connect
    from ..query.threads import cores
    from .app import Limits, build_app
    from .pool import Pool

    if query_timeout is not None and not query_timeout > 0:
        raise ServeError(f"query_timeout is a number of seconds above 0, not {query_timeout!r}")
    if max_rows < 1:
        raise ServeError(f"max_rows is at least 1, not {max_rows!r}")
    if token is not None and (len(token) < 16 or not set(token) <= _TOKEN_CHARS):
        raise ServeError("the token must be at least 16 characters of A-Z a-z 0-9 - . _ ~ "
                         "(a random one is made when --host is not local and none is given)")
    if token is None and host not in LOCAL:
        token = secrets.token_urlsafe(24)
    connect(store, device=device).close()  # a missing or damaged store is said now, once
    sock = _listen(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
    pool = Pool(lambda: connect(store, device=device, cache_bytes=64 << 20,
                                timeout=query_timeout),
                size=connections or min(8, max(2, cores())))
    app = build_app(pool, Limits(query_timeout=query_timeout, max_rows=max_rows), token=token)
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2)
    announce(f"actdb explorer for {os.fspath(store)}: open {address}")
    if token and host not in LOCAL:
        announce("every request must carry the token (the address above sets it as a cookie)")
    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Ctrl-C: stop the queries first, so that their requests end now and the
            # server's wait for open requests is short
            pool.cancel_all()
            super().handle_exit(sig, frame)

    try:
        Server(config).run(sockets=[sock])
    finally:
        pool.close()
        sock.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one sentence saying why there cannot be one."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(where)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


__all__ = ["serve"]
