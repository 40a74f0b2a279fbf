"""`actdb serve` in a subprocess, for the explorer's tests: started on a free port, its address
read from what it prints, stopped (and its output shown on failure) when the block ends."""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str  # e.g. http://127.0.0.1:41234/ (with ?token=... when it printed one)
    process: subprocess.Popen[str]

    @property
    def base(self) -> str:
        return self.url.split("?")[0]

    def post(self, path: str, body: Any, *, headers: dict[str, str] | None = None,
             timeout: float = 120) -> tuple[int, Any, dict[str, str]]:
        """POST JSON; returns (status, decoded JSON or raw bytes, headers)."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.base + path.lstrip("/"), data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        return _send(req, timeout)

    def query(self, sql: str, params: Any = None, **kw: Any) -> tuple[int, Any]:
        status, body, _ = self.post("/api/query", {"sql": sql, "params": params}, **kw)
        return status, body

    def get(self, path: str, *, headers: dict[str, str] | None = None,
            timeout: float = 60) -> tuple[int, Any, dict[str, str]]:
        req = urllib.request.Request(self.base + path.lstrip("/"), headers=headers or {})
        return _send(req, timeout)


def _send(req: urllib.request.Request, timeout: float) -> tuple[int, Any, dict[str, str]]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, headers = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), dict(e.headers)
    kind = headers.get("content-type", headers.get("Content-Type", ""))
    return status, (json.loads(raw) if kind.startswith("application/json") else raw), headers


@contextmanager
def running(store: Path | str, *args: str, startup: float = 60) -> Iterator[Server]:
    """`actdb serve STORE --port 0 ARGS...` until the block ends."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actdb", "serve", str(store), "--port", "0", "--device", "cpu",
         *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _address(proc, startup)
        yield Server(url=url, process=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _address(proc: subprocess.Popen[str], startup: float) -> str:
    """The address the server prints on its first line of standard output."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + startup
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if not line:
                break
            found = re.search(r"open (http://\S+)", line)
            if found:
                return found.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"actdb serve did not print its address: {err}")
