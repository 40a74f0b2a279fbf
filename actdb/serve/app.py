"""The explorer's web application: its pages, its API, and the pool its queries run on.

Routes:
- `GET /`, `/input`, `/cell`, `/trajectory`, `/sql`: the pages (static HTML and JavaScript
  shipped in this package, `static/`; each page asks the API for its data and shows the SQL).
- `POST /api/query` `{"sql", "params"}`: `{"columns", "rows", "row_count", "truncated"}`, or
  with `Accept: application/vnd.apache.arrow.stream` (or `"format": "arrow"`) the rows as an
  Arrow IPC stream; `{"error"}` with status 400 for a query that fails, in the CLI's words.
- `POST /api/trajectory` `{"model", "prompt_id", "positions", "role"}`: projection.py.
- `GET /api/functions`: the tensor functions' signatures and docs, as `actdb functions`.

Each query runs on the pool (pool.py) under the time and row limits; the handler watches its
client while the query runs and cancels it if the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import ActdbError
from . import encode
from .guard import Guard
from .pool import Answer, Job, Pool, run_sql
from .projection import trajectory

PAGES = {"/": "inputs.html", "/input": "input.html", "/cell": "cell.html",
         "/trajectory": "trajectory.html", "/sql": "sql.html"}
# How often a handler checks whether its client is still there while the query runs.
WATCH_SECONDS = 0.1
# A request body larger than this is refused (a query and its parameters are far smaller).
MAX_BODY_BYTES = 4 << 20
# A query still running this long after its time limit is answered as timed out anyway.
GRACE_SECONDS = 5.0


@dataclass(frozen=True, kw_only=True)
class Limits:
    query_timeout: float | None  # seconds; None: no limit
    max_rows: int


def static_dir() -> str:
    return str(resources.files("actdb.serve") / "static")


def build_app(pool: Pool, limits: Limits, *, token: str | None) -> Guard:
    """The ASGI application: the routes behind the request guard (guard.py)."""
    folder = static_dir()

    def page(name: str) -> Any:
        async def show(request: Request) -> Response:
            return FileResponse(f"{folder}/{name}", media_type="text/html",
                                headers={"cache-control": "no-store"})
        return show

    async def query(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, Response):
            return body
        sql, params = body.get("sql"), body.get("params")
        if not isinstance(sql, str) or not sql.strip():
            return _error("send the SQL as a non-empty string: {\"sql\": \"SELECT ...\"}")
        if params is not None and not isinstance(params, dict | list):
            return _error("params is an object ({\"name\": value} for $name) or a list (for ? "
                          f"and $1), not {type(params).__name__}")
        arrow = body.get("format") == "arrow" or encode.ARROW_STREAM in request.headers.get(
            "accept", "")
        job = pool.submit(lambda db: run_sql(db, sql, params, limits.max_rows),
                          timeout=limits.query_timeout)
        answer = await _wait(request, job)
        if isinstance(answer, Response):
            return answer
        assert isinstance(answer, Answer)
        if arrow:
            return Response(encode.arrow_stream(answer.table), media_type=encode.ARROW_STREAM,
                            headers={"x-actdb-truncated": str(answer.truncated).lower(),
                                     "x-actdb-max-rows": str(answer.max_rows)})
        return _json({"columns": answer.table.column_names,
                      "rows": encode.json_rows(answer.table),
                      "row_count": answer.table.num_rows, "truncated": answer.truncated,
                      "max_rows": answer.max_rows, "seconds": round(answer.seconds, 4)})

    async def paths(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, Response):
            return body
        try:
            kw = _trajectory_args(body)
        except ValueError as e:
            return _error(str(e))
        job = pool.submit(lambda db: trajectory(db, **kw), timeout=limits.query_timeout)
        answer = await _wait(request, job)
        return answer if isinstance(answer, Response) else _json(answer)

    async def functions(request: Request) -> Response:
        from ..query import Database

        return _json({"functions": Database.functions()})

    async def limits_info(request: Request) -> Response:
        return _json({"query_timeout": limits.query_timeout, "max_rows": limits.max_rows})

    routes: list[BaseRoute] = [Route(path, page(name)) for path, name in PAGES.items()]
    routes += [
        Route("/api/query", query, methods=["POST"]),
        Route("/api/trajectory", paths, methods=["POST"]),
        Route("/api/functions", functions),
        Route("/api/limits", limits_info),
        Route("/favicon.ico", lambda request: FileResponse(f"{folder}/favicon.svg",
                                                           media_type="image/svg+xml")),
        Mount("/static", StaticFiles(directory=folder), name="static"),
    ]
    app = Starlette(routes=routes)
    return Guard(app, token=token)


async def _body(request: Request) -> dict[str, Any] | Response:
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            return _error(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", 413)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return _error("the request body is not JSON")
    if not isinstance(body, dict):
        return _error("the request body is a JSON object: {\"sql\": ..., \"params\": ...}")
    return body


async def _wait(request: Request, job: Job) -> Any:
    """The job's result, or the error response; cancels the job if the client goes away."""
    waiting = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=WATCH_SECONDS)
        if done:
            break
        if await request.is_disconnected():
            job.cancel("gone")
        elif job.overdue(GRACE_SECONDS):
            job.cancel("timeout")
            return _error(encode.error_text(job.error()))
    try:
        return waiting.result()
    except ActdbError as e:
        return _error(encode.error_text(e))
    except Exception as e:  # noqa: BLE001 - a fault of ours, said as JSON like the rest
        return _error(f"internal error: {type(e).__name__}: {e}", 500)


def _trajectory_args(body: dict[str, Any]) -> dict[str, Any]:
    """The trajectory request's fields, checked; ValueError says which is wrong."""
    model, role = body.get("model"), body.get("role", "pre_attn")
    prompt_id, positions = body.get("prompt_id"), body.get("positions")
    if not isinstance(model, str) or not isinstance(role, str):
        raise ValueError("model and role are strings")
    if not isinstance(prompt_id, int) or isinstance(prompt_id, bool):
        raise ValueError("prompt_id is an integer")
    if (not isinstance(positions, list) or not positions or len(positions) > 64
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions)):
        raise ValueError("positions is a list of 1 to 64 integers")
    return {"model": model, "prompt_id": prompt_id, "positions": positions, "role": role}


def _error(text: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": text}, status_code=status)


def _json(data: Any) -> Response:
    return Response(json.dumps(data, allow_nan=False), media_type="application/json")
