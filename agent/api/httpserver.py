"""uvicorn, hardened against clients that connect and then do nothing useful.

uvicorn (0.54, h11) alone leaves four holes that one unauthenticated client can use:
- a connection that never sends a request is never closed: the keep-alive timer starts only
  after a first response, and any byte received cancels it, so slowly dripped headers never time
  out either;
- connections are not capped short of the fd limit. Its `limit_concurrency` answers 503 once the
  cap is reached, so idle connections would lock scrapes out; and at the fd limit asyncio's accept
  loop (CPython 3.11 selector_events._accept_connection) keeps calling accept() for the rest of its
  batch after EMFILE, logging a traceback for each failure, batch after batch;
- a client that never reads its response parks the request task in a drain forever, and a
  graceful shutdown waits for it ("Waiting for connections to close") forever;
- every malformed request logs a warning line.

GuardedProtocol closes those with uvicorn's own h11 protocol underneath, so HTTP parsing and
ASGI stay uvicorn's: a request deadline from connection (or previous response) until the request
has fully arrived, a cap on connections that makes room by closing the oldest connection still
waiting for its request, and a deadline on a stalled write. AgentServer bounds the graceful
shutdown, answers fd exhaustion by shedding idle connections, aggregates repeated warnings
(agent/logs.py), and hands SIGTERM/SIGINT on to the caller's handler the moment they arrive, so
that the log tells the shutdown in the order it happens. A different server was not needed: each gap is a few lines over uvicorn's hooks.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import signal
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridmon.agent.api.web_config import WebConfigFile
from hybridmon.agent.logs import RepeatedMessageFilter, aggregate_repeats, remove_filter

log = logging.getLogger(__name__)

# Loggers a client can make write once per connection or request; their repeats are aggregated.
CHATTY_LOGGERS = ("uvicorn.error", "asyncio", __name__)

# File descriptors the agent needs besides client connections: about 10 at rest (stdio, the
# listening socket, the event loop's selector, udev's netlink socket), plus NVML (a few per GPU),
# /proc reads by up to 8 collector threads at once, bench result files. Generous on purpose.
RESERVED_FDS = 64
# A metrics agent has a handful of legitimate clients (Prometheus, a status page, curl); 512 idle
# connections cost ~5 MB. The cap only matters against floods, where a lower one sheds sooner.
MAX_CONNECTIONS = 512
# asyncio accepts up to `backlog` connections per readiness event, before any of them reaches
# the protocol (and the cap): a small batch keeps that overshoot small.
ACCEPT_BATCH = 32
# The kernel's queue of connections not yet accepted; re-set after asyncio set it to the batch
# size, so that a burst of connects is queued rather than SYN-dropped (a 1 s retransmit for a
# scrape caught in it).
LISTEN_BACKLOG = 1024
# After the graceful deadline has aborted every connection, how long requests still running (a
# handler stuck in a thread) get before uvicorn cancels them.
SHUTDOWN_BACKSTOP_SECONDS = 2.0


@dataclass(frozen=True)
class ServerLimits:
    """Every bound the server keeps, in seconds and connections."""

    # From connection (or from the previous response, on keep-alive) until the whole request,
    # headers and body, has arrived. A scrape request arrives in one packet.
    request_timeout_seconds: float = 5.0
    # A response that the client has not read for this long (the socket buffer stayed full) is
    # abandoned and the connection aborted.
    write_stall_timeout_seconds: float = 10.0
    # SIGTERM: requests in flight get this long to finish; then connections are aborted (and,
    # SHUTDOWN_BACKSTOP_SECONDS later, handlers still running are cancelled). The unit's
    # TimeoutStopSec must be well above both (the collectors stop after the server).
    graceful_shutdown_seconds: float = 3.0
    # None: derived from RLIMIT_NOFILE (connection_cap).
    max_connections: int | None = None
    # Repeated warnings: one line per message per window, with a count.
    log_window_seconds: float = 60.0


def connection_cap(soft_nofile_limit: int) -> int:
    """Connections served at once under this fd limit: half of what the reserve leaves, so the
    other half absorbs accept batches (up to 3 x ACCEPT_BATCH in flight before the cap applies)."""
    return max(8, min(MAX_CONNECTIONS, (soft_nofile_limit - RESERVED_FDS) // 2))


class ConnectionGuard:
    """The open connections, oldest first, and what the server did to keep within its limits."""

    def __init__(self, limits: ServerLimits, peer_allowed: Callable[[dict | None], bool] | None = None) -> None:
        self.limits = limits
        # A check of the TLS client's verified certificate (client_allowed_sans, agent/api/web_config.py).
        self.peer_allowed = peer_allowed
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.max_connections = limits.max_connections or connection_cap(soft)
        self.open: OrderedDict[GuardedProtocol, None] = OrderedDict()
        # Counters since start: connections closed because ...
        self.evicted = 0  # ... the cap was reached and they were still waiting for a request
        self.refused = 0  # ... the cap was reached and none could be evicted for them
        self.request_timeouts = 0  # ... their request did not arrive in time
        self.write_stalls = 0  # ... they did not read their response
        self.accept_failures = 0  # accept() failed for lack of fds (shed_idle ran)

    def admit(self, connection: GuardedProtocol) -> bool:
        """Register a new connection; False if it has to be closed at once."""
        self.open[connection] = None
        while len(self.open) > self.max_connections:
            victim = next((c for c in self.open if c is not connection and c.waiting_for_request()), None)
            if victim is None:
                self.refused += 1
                self.open.pop(connection, None)
                return False
            self.evicted += 1
            victim.close_now()
        return True

    def served(self, connection: GuardedProtocol) -> None:
        """A response was completed: the connection is now the newest, last in line for eviction."""
        if connection in self.open:
            self.open.move_to_end(connection)

    def forget(self, connection: GuardedProtocol) -> None:
        self.open.pop(connection, None)

    def shed_idle(self, fraction: float = 0.5) -> int:
        """Close the oldest `fraction` of connections waiting for a request; how many were closed."""
        idle = [c for c in self.open if c.waiting_for_request()]
        victims = idle[:max(1, int(len(idle) * fraction))] if idle else []
        for victim in victims:
            victim.close_now()
        self.evicted += len(victims)
        return len(victims)


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a request deadline, a connection cap and a write-stall deadline.

    `guard` is set on a subclass per server (protocol_for), since uvicorn builds protocols itself.
    """

    guard: ConnectionGuard

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._request_deadline: asyncio.TimerHandle | None = None
        self._stall_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self) or not self._peer_allowed(transport):
            self.close_now()
            return
        self._arm_request_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.waiting_for_request():
            self._cancel(self._request_deadline)
            self._request_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.guard.served(self)
        if not self.transport.is_closing() and self.waiting_for_request():
            self._arm_request_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_deadline is None:
            self._stall_deadline = self.loop.call_later(
                self.guard.limits.write_stall_timeout_seconds, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._stall_deadline)
        self._stall_deadline = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers 400 itself when a request turns out malformed after its route started
        (an invalid chunk in the body: issue 30). The route, still running, would then answer into
        h11's MUST_CLOSE state and uvicorn log an ERROR with a 47-line traceback. Its request is
        ended as a client that went away instead (its receive() says http.disconnect, its send()
        is dropped); had it begun its answer, the connection is only closed."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if started:
                self.transport.close()
                return
        super().send_400_response(msg)

    def _peer_allowed(self, transport: asyncio.Transport) -> bool:
        # asyncio hands a TLS connection over only once its handshake is done, with the certificate.
        return self.guard.peer_allowed is None or self.guard.peer_allowed(transport.get_extra_info("peercert"))

    def waiting_for_request(self) -> bool:
        """The next request has not fully arrived yet (h11 leaves IDLE at its request line and
        SEND_BODY at the end of its body); idle keep-alive connections are waiting too."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def close_now(self) -> None:
        """Abort: an idle or hostile peer gets no graceful close, its fd is freed at once."""
        self.guard.forget(self)
        self._cancel_timers()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def _arm_request_deadline(self) -> None:
        self._cancel(self._request_deadline)
        self._request_deadline = self.loop.call_later(
            self.guard.limits.request_timeout_seconds, self._request_timed_out)

    def _request_timed_out(self) -> None:
        self._request_deadline = None
        if self.waiting_for_request():
            self.guard.request_timeouts += 1
            self.close_now()

    def _write_stalled(self) -> None:
        self._stall_deadline = None
        self.guard.write_stalls += 1
        log.warning("a client did not read its response for %.0f s: connection closed",
                    self.guard.limits.write_stall_timeout_seconds)
        self.close_now()

    def _cancel_timers(self) -> None:
        self._cancel(self._request_deadline)
        self._cancel(self._stall_deadline)
        self._request_deadline = self._stall_deadline = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def protocol_for(guard: ConnectionGuard) -> type[GuardedProtocol]:
    return type("GuardedProtocolForServer", (GuardedProtocol,), {"guard": guard})


# uvicorn's main loop wakes every 0.1 s to refresh the Date header (once a second) and to look at
# should_exit: ten wake-ups a second of an otherwise idle main thread, 1.7 ms of CPU a second measured
# on the 2-vCPU VM with every collector off (issue 33's budget is 10 ms/s for the whole daemon).
# AgentServer's wakes once a second, and at once when should_exit is set (a signal, another thread).
MAIN_LOOP_WAKE_SECONDS = 1.0


class AgentServer(uvicorn.Server):
    """uvicorn.Server with a bounded shutdown, fd-exhaustion shedding and aggregated warnings."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard, repeats: RepeatedMessageFilter) -> None:
        super().__init__(config)
        self.guard = guard
        self.repeats = repeats
        self._last_shed = float("-inf")  # event loop seconds
        self._outer_handlers: dict[int, object] = {}  # signal -> the handler uvicorn displaced
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # while main_loop runs

    @property
    def should_exit(self) -> bool:
        return vars(self).get("_should_exit", False)

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        wake = vars(self).get("_wake")
        if value and wake is not None:
            loop, event = wake
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to wake
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        """uvicorn's loop, woken once a second (MAIN_LOOP_WAKE_SECONDS) instead of every 0.1 s."""
        self._wake = (asyncio.get_running_loop(), asyncio.Event())
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            # on_tick counts uvicorn's 0.1 s ticks: its once-a-second work is due at every wake
            counter = (counter + 10) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake[1].wait(), MAIN_LOOP_WAKE_SECONDS)
            should_exit = await self.on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn swaps in its own SIGTERM/SIGINT handler while it serves and re-raises the signal
        # to the displaced one only after its shutdown, so the caller's "received SIGTERM,
        # stopping" came after uvicorn's "Finished server process". Remember the displaced
        # handlers, and hand each signal on the moment it arrives (handle_exit).
        if threading.current_thread() is threading.main_thread():
            self._outer_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        with super().capture_signals():
            yield

    def handle_exit(self, sig: int, frame) -> None:
        outer = self._outer_handlers.get(sig)
        # Python's own SIGINT handler raises KeyboardInterrupt: that one, like a default or ignored
        # disposition, is left to uvicorn's re-raise after its graceful shutdown, as before.
        forward = callable(outer) and outer is not signal.default_int_handler
        if forward:
            outer(sig, frame)  # type: ignore[operator]
        super().handle_exit(sig, frame)
        if forward:
            # Delivered already: uvicorn's re-raise after shutdown would deliver it a second time.
            self._captured_signals.remove(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_exception)
        if self.config.ssl is not None:
            # A TLS connection reaches the protocol (and the guard's cap and request deadline) only
            # once its handshake is done; asyncio gives a handshake 60 s by default, which would let
            # silent connections hold fds past the guard. uvicorn passes no handshake timeout to
            # create_server, so it is bound in here, for this one call, to the request deadline.
            loop.create_server = functools.partial(  # type: ignore[method-assign]
                type(loop).create_server, loop, ssl_handshake_timeout=self.guard.limits.request_timeout_seconds)
        try:
            await super().startup(sockets=sockets)
        finally:
            vars(loop).pop("create_server", None)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0:  # uvicorn's ticks are 0.1 s: once a second
            self.repeats.flush()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn waits for connections to finish their responses; a client that reads nothing
        # never lets its response finish. At the graceful deadline those connections are aborted,
        # which ends their requests as disconnects (no task cancelled mid-send, no traceback).
        # uvicorn's own timeout, a little later, stays as the backstop for a stuck handler.
        deadline = asyncio.get_running_loop().call_later(
            self.guard.limits.graceful_shutdown_seconds, self._abort_connections)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            deadline.cancel()
            self._abort_connections()
            self.repeats.flush()

    def _abort_connections(self) -> None:
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.abort()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if context.get("message") == "socket.accept() out of system resource":
            self.guard.accept_failures += 1
            # asyncio reports each failed accept of a batch and retries after 1 s: shed once per
            # retry, not once per report, or one batch would close every idle connection.
            now = loop.time()
            shed = 0
            if now - self._last_shed >= 1.0:
                self._last_shed = now
                shed = self.guard.shed_idle()
            log.warning("cannot accept connections (%s): %d open, cap %d; closed %d idle ones",
                        error, len(self.guard.open), self.guard.max_connections, shed)
            return
        loop.default_exception_handler(context)


def build_server(app, limits: ServerLimits, log_level: str, web_config: WebConfigFile | None = None) -> AgentServer:
    """The server for `app`; run it with .run(sockets=[sock]) from the main thread. With a web config
    file, HTTPS on the context it builds (agent/api/web_config.py) instead of HTTP."""
    guard = ConnectionGuard(limits, peer_allowed=web_config.peer_allowed if web_config else None)
    ssl_context = web_config.server_context() if web_config else None
    config = uvicorn.Config(
        app,
        http=protocol_for(guard),
        log_level=log_level,
        # No logging config of uvicorn's own ("INFO:     Started server process"): its loggers
        # propagate to the root logger, whose one handler formats every line (agent/logs.py).
        log_config=None,
        access_log=False,
        lifespan="off",
        # No limit_concurrency: it answers 503 to every request past the cap, idle connections
        # included. The guard caps connections and evicts idle ones instead.
        timeout_keep_alive=limits.request_timeout_seconds,  # type: ignore[arg-type]
        timeout_graceful_shutdown=limits.graceful_shutdown_seconds + SHUTDOWN_BACKSTOP_SECONDS,  # type: ignore[arg-type]
        backlog=ACCEPT_BATCH,
        server_header=False,
        # asyncio's loop, not uvloop should it be installed: AgentServer.startup bounds TLS handshakes on it.
        loop="asyncio",
        ssl_context_factory=(lambda _config, _default: ssl_context) if ssl_context else None,
    )
    # uvicorn.Config configured its loggers just now: attach the filter after that.
    repeats = aggregate_repeats(CHATTY_LOGGERS, limits.log_window_seconds)
    return AgentServer(config, guard, repeats)


def stop_aggregating(server: AgentServer) -> None:
    remove_filter(server.repeats, CHATTY_LOGGERS)
