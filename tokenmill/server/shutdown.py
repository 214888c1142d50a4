"""Graceful shutdown: SIGTERM drains instead of dropping.

On the first SIGTERM/SIGINT the server keeps its socket open but answers every new request
with 503 (so a load balancer moves on and a client gets a clear answer, not a reset), waits
up to `shutdown_timeout` for in-flight requests to finish, aborts whatever is left, then
lets uvicorn close. A second signal exits at once. We override uvicorn's `handle_exit`
because uvicorn re-raises the captured signal after its shutdown, which would end the
process with "killed by SIGTERM" instead of exit code 0.
"""
from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from tokenmill.server.state import ServerState

log = logging.getLogger("tokenmill")

POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:
            log.warning("second signal: exiting now")
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True     # from here on, new requests get 503
        # signal handlers run between bytecodes of the main thread; call_soon_threadsafe also
        # wakes the event loop if it is blocked in select()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        st = self.state
        log.info("shutdown: draining %d in-flight request(s), up to %.0fs", st.active_requests, self.shutdown_timeout)
        deadline = time.monotonic() + self.shutdown_timeout
        while st.active_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if st.active_requests > 0:
            log.warning("shutdown: timeout; aborting %d request(s)", st.active_requests)
            st.engine.abort_all("server shutting down")
            # give the handlers a moment to send their error and finish
            end = time.monotonic() + 2.0
            while st.active_requests > 0 and time.monotonic() < end:
                await asyncio.sleep(POLL_S)
        self.should_exit = True
