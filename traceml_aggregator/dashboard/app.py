"""The dashboard's HTTP server (aiohttp), on the event loop that runs it.

Routes (``TOKEN`` is the run token; see :func:`check_token`):

* ``GET /?token=TOKEN``: the page (``static/index.html``);
* ``GET /api/frame?token=TOKEN``: the whole run now, one JSON frame
  (:mod:`traceml_aggregator.dashboard.frames`); ``&metric=NAME`` picks the figure of its scale
  views (``step`` or a phase; ``step`` by default), as on the next route;
* ``GET /api/events?token=TOKEN``: server-sent events, one ``data:`` line of JSON per frame:
  everything at first, then every :data:`REFRESH_S` what changed since (new points, the
  tables whole), and a comment line every :data:`KEEPALIVE_S` when nothing did; above
  :data:`~traceml.report.grid.SCALE_RANKS` ranks each frame holds the scale views of the
  figure ``&metric=NAME`` names (the page opens a new stream to change it);
* ``GET /static/...``: the page's script and style and the vendored uPlot, without a token
  (they hold no run data; see ``static/uplot/VERSION``).

Every route but ``/static/`` answers 401 with a one-line body when the token is missing or
wrong (compared in constant time, :func:`hmac.compare_digest`); a header
``Authorization: Bearer TOKEN`` is accepted too. The link with the token is never printed: it
is written, mode 0600, to the run directory's ``dashboard_link`` (:func:`write_link`), and the
console shows the URL without it and that file's path. With a TLS context (the aggregator's
``--tls-cert``/``--tls-key``, as its gRPC port's) the page is served over HTTPS.

Cost: one :class:`~traceml_aggregator.dashboard.frames.Snapshot` at most every
:data:`REFRESH_S`, and only while someone watches and the data changed, shared by every viewer;
each viewer then costs only its new points (and the tables: O(ranks)). A live snapshot is built
in the live analysis process from its mirror of the windows, the loop paying only what changed
since the last one; a stored run's on a thread. Building takes at most :data:`BUILD_DUTY` of the
time (figures: ``benchmarks/dashboard.py``).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path

from aiohttp import web

from traceml.core import endpoint, transport
from traceml.core.rundir import DASHBOARD_LINK_FILE_NAME
from traceml.core.transport import same_token
from traceml_aggregator.auth import bearer
from traceml_aggregator.dashboard.frames import Cursor, Snapshot

STATIC_DIR = Path(__file__).with_name("static")
#: Seconds between two frames to a viewer (when the data changed).
REFRESH_S = 1.0
#: Seconds between two keep-alive comments on an idle event stream.
KEEPALIVE_S = 15.0
#: Largest fraction of wall time spent building snapshots (in the live analysis process, or on
#: a thread for a stored run), as the live analysis's ANALYSIS_DUTY bounds its own.
BUILD_DUTY = 0.1
#: Seconds after the last viewer's last request when the live verdict stops being refreshed.
IDLE_AFTER_S = 10.0
#: The body of every 401 answer.
UNAUTHORIZED = (
    "401 Unauthorized: missing or wrong run token; open the link in the run directory's "
    f"{DASHBOARD_LINK_FILE_NAME} file (it ends in ?token=...)\n"
)
_TOKEN_KEY = web.AppKey("token", str)
_HUB_KEY = web.AppKey("hub", object)
_STATIC_KEY = web.AppKey("static", object)


def check_token(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``token`` (``?token=`` or ``Authorization: Bearer``),
    compared in constant time."""
    given = request.query.get("token")
    if given is None:
        given = bearer(request.headers.get("Authorization"))
    return same_token(given, token)


@web.middleware
async def _token_gate(request: web.Request, handler):
    # By the route matched, not by the path's text: no spelling of a path reaches another
    # route without the token.
    static = request.match_info.route.resource is request.app[_STATIC_KEY]
    if not static and not check_token(request, request.app[_TOKEN_KEY]):
        return web.Response(status=401, text=UNAUTHORIZED)
    return await handler(request)


class Hub:
    """The latest :class:`Snapshot` of ``source``, shared by every viewer (see the module
    docstring); its live verdict is refreshed by one task while anyone watches."""

    def __init__(self, source, refresh_s: float = REFRESH_S) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self.closing = asyncio.Event()
        self._snapshot: Snapshot | None = None
        self._summary: dict | None = None
        self._summary_version = 0  # bumped whenever a new summary arrives
        self._built_for: tuple[int, int] | None = None
        self._lock = asyncio.Lock()
        self._verdicts: asyncio.Task | None = None
        self._asked = 0.0  # time.monotonic() of the last snapshot asked for
        self._next_build = 0.0  # time.monotonic() before which no snapshot is built

    async def snapshot(self) -> Snapshot:
        """The snapshot of the data as it is now; rebuilt when it changed, at most every
        ``refresh_s`` and at most :data:`BUILD_DUTY` of the time (after a build of t seconds
        the next waits ``t * (1 / BUILD_DUTY - 1)``); a caller meanwhile gets the last one."""
        self._asked = time.monotonic()
        if self._verdicts is None or self._verdicts.done():
            self._verdicts = asyncio.get_running_loop().create_task(self._refresh_verdicts())
        if self._snapshot is None:
            self._summary = await self.source.summary()
        async with self._lock:
            key = (self.source.version(), self._summary_version)
            fresh = self._snapshot is not None and (
                key == self._built_for or time.monotonic() < self._next_build
            )
            if not fresh:
                started = time.monotonic()
                self._snapshot = await self.source.snapshot(self._summary, key[0])
                self._built_for = key
                took = time.monotonic() - started
                self._next_build = time.monotonic() + max(
                    self.refresh_s - took, took * (1.0 / BUILD_DUTY - 1.0)
                )
            return self._snapshot

    async def _refresh_verdicts(self) -> None:
        """Keep the latest summary (the source throttles its own analysis) while someone
        watches: it ends :data:`IDLE_AFTER_S` after the last snapshot asked for."""
        if not self.source.live:
            return
        while not self.closing.is_set() and time.monotonic() - self._asked < IDLE_AFTER_S:
            summary = await self.source.summary()
            if summary is not None and summary is not self._summary:
                self._summary = summary
                self._summary_version += 1
            try:
                await asyncio.wait_for(self.closing.wait(), self.refresh_s)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        """End every event stream and the verdict task."""
        self.closing.set()
        if self._verdicts is not None:
            self._verdicts.cancel()


def _cursor(request: web.Request) -> Cursor:
    """A new viewer's cursor, its scale views' figure from ``?metric=`` (``step`` else)."""
    return Cursor(metric=request.query.get("metric", "step"))


async def _page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def _frame(request: web.Request) -> web.Response:
    snapshot = await request.app[_HUB_KEY].snapshot()
    return web.Response(
        body=snapshot.encode(_cursor(request)),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _events(request: web.Request) -> web.StreamResponse:
    hub: Hub = request.app[_HUB_KEY]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    cursor, sent_for, quiet_since = _cursor(request), None, time.monotonic()
    try:
        while not hub.closing.is_set():
            snapshot = await hub.snapshot()
            if snapshot is not sent_for:
                # "full": the first frame of a stream holds everything (the page starts over:
                # after a reconnection it would otherwise hold every point twice).
                frame = snapshot.encode(cursor, full=sent_for is None)
                await response.write(b"data: " + frame + b"\n\n")
                sent_for, quiet_since = snapshot, time.monotonic()
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                await response.write(b": keep-alive\n\n")
                quiet_since = time.monotonic()
            try:
                await asyncio.wait_for(hub.closing.wait(), hub.refresh_s)
            except asyncio.TimeoutError:
                pass
    except ConnectionResetError:
        pass  # the viewer left
    return response


def make_app(source, token: str) -> web.Application:
    """The dashboard application over ``source`` (one of
    :mod:`traceml_aggregator.dashboard.sources`), protected by ``token``.

    Raises:
        ValueError: ``token`` is empty.
    """
    if not token:
        raise ValueError("the dashboard needs the run token")
    app = web.Application(middlewares=[_token_gate])
    app[_TOKEN_KEY] = token
    hub = app[_HUB_KEY] = Hub(source)
    app.router.add_get("/", _page)
    app.router.add_get("/api/frame", _frame)
    app.router.add_get("/api/events", _events)
    app[_STATIC_KEY] = app.router.add_static("/static/", STATIC_DIR)

    async def on_shutdown(_app) -> None:
        await hub.close()

    app.on_shutdown.append(on_shutdown)
    return app


def write_link(path: Path, url: str, token: str) -> None:
    """Write the page's link (``url`` of :func:`traceml.core.endpoint.dashboard_url` with
    ``token``) to ``path``, mode 0600: what the user opens, since no console line holds it.

    Raises:
        OSError: the file cannot be written.
    """
    transport.write_token_file(path, endpoint.dashboard_link(url, token) + "\n")


async def start(
    source, host: str, port: int, token: str, ssl_context: ssl.SSLContext | None = None
) -> web.AppRunner:
    """Serve the dashboard of ``source`` on ``host:port`` (call on the event loop that is to
    run it), over HTTPS with ``ssl_context``; ``await runner.cleanup()`` stops it (event
    streams end within a second).

    Raises:
        OSError: the port cannot be bound.
    """
    runner = web.AppRunner(make_app(source, token), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
