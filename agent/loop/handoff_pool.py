"""The collectors' threads: a tick's collectors run one after another on one thread, and a collector
still running after a hand-off time leaves the rest of the queue to another thread.

Why not a thread per collector (concurrent.futures.ThreadPoolExecutor, as before): a tick starts a
dozen collectors at once, each reading files for about a millisecond, and threads that run at once
hand the GIL to each other at every read() one of them makes, each hand-off a futex wake and a
context switch. On the 8-GPU / 16-process benchmark host (benchmarks/daemon_long_run.py, counters
path, idle 2-vCPU VM, the two run side by side) that was 287 wake-ups a second and 12.5 ms/s of the
collector threads' CPU; the same collectors run one after another: 4.8 wake-ups a second, 9.1 ms/s.

What the thread per collector gave is kept: a collector that hangs (NVML when a GPU falls off the
bus, a /proc read behind a process's mmap lock, a server that does not answer) holds up the others
by `handoff_seconds` at most, then holds one thread of its own while another takes the queue; up to
`max_workers` threads, one per collector, so even every collector hung leaves the tick running.
Threads are daemon threads: one stuck in a call that never returns must not keep the agent from
exiting on SIGTERM (ThreadPoolExecutor joins its threads at exit).

Wake-ups a tick: the thread that runs the queue once, and one standby thread twice (when work
arrives while another runs, and when its hand-off wait ends): about 3, against one per GIL hand-off.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class HandoffPool:
    """submit(task, *args) queues a task; tasks run in order, on as few threads as hangs allow."""

    def __init__(self, max_workers: int, handoff_seconds: float, thread_name_prefix: str,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if max_workers < 1 or handoff_seconds <= 0:
            raise ValueError(f"max_workers must be >= 1 and handoff_seconds > 0, "
                             f"not {max_workers} and {handoff_seconds}")
        self._max_workers = max_workers
        self._handoff_seconds = handoff_seconds
        self._prefix = thread_name_prefix
        self._monotonic = monotonic
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._changed = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._starting = 0   # threads started that have not yet looked at the queue: as good as idle
        # when each thread running a task started it (monotonic), by thread
        self._running_since: dict[int, float] = {}
        self._shut_down = False

    def submit(self, task: Callable[..., Any], *args: Any) -> None:
        with self._changed:
            if self._shut_down:
                raise RuntimeError("cannot schedule new tasks after shutdown")
            was_empty = not self._queue
            self._queue.append((task, args))
            # Wake a thread only where one must act now: none runs a task, so one takes this; or
            # the queue was empty, so the standby must start its hand-off wait. Tasks queued behind
            # a running one wake nobody: its thread takes them when it is done.
            if not self._running_since or was_empty:
                self._wake_one()

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Drop what is queued (ThreadPoolExecutor's signature: the Sampler's stop calls it so);
        running tasks finish in their threads, which then end."""
        with self._changed:
            self._shut_down = True
            if cancel_futures:
                self._queue.clear()
            self._changed.notify_all()
        if wait:
            for thread in list(self._threads):
                thread.join()

    @property
    def threads(self) -> int:
        """Threads started so far: 2 while nothing hangs (the one that runs the queue and the
        standby), one more for each task that hung."""
        with self._changed:
            return len(self._threads)

    def _wake_one(self) -> None:
        """Under the lock: an idle thread, else a new one while fewer than max_workers run."""
        if self._idle:
            self._changed.notify()
        elif not self._starting and len(self._threads) < self._max_workers:
            self._starting += 1
            thread = threading.Thread(target=self._work, daemon=True,
                                      name=f"{self._prefix}_{len(self._threads)}")
            self._threads.append(thread)
            thread.start()

    def _take(self, me: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Under the lock: the queue's next task, for thread `me`. While tasks wait behind it, a
        standby must watch for its hang: wake or start one where none is idle."""
        self._running_since[me] = self._monotonic()
        item = self._queue.popleft()
        if self._queue and not self._idle:
            self._wake_one()
        return item

    def _next_task(self, me: int) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        """Under the lock: wait until thread `me` should take a task (None: shut down). It takes
        one when none runs, or when every running task has run `handoff_seconds` (hung, or slow:
        the others must not wait on it longer); otherwise it waits that long for the newest."""
        while True:
            if self._shut_down:
                return None
            timeout = None
            if self._queue:
                newest = max(self._running_since.values(), default=None)
                if newest is None or self._monotonic() - newest >= self._handoff_seconds:
                    return self._take(me)
                timeout = newest + self._handoff_seconds - self._monotonic()
            self._idle += 1
            try:
                self._changed.wait(timeout)
            finally:
                self._idle -= 1

    def _work(self) -> None:
        me = threading.get_ident()
        with self._changed:
            self._starting -= 1
            item = self._next_task(me)
        while item is not None:
            task, args = item
            try:
                task(*args)
            except Exception:  # a task keeps its own errors (the Sampler's run_collector does)
                log.exception("collector task failed")
            with self._changed:
                if self._queue and not self._shut_down:
                    item = self._take(me)   # at once, waking nobody: the point of the pool
                else:
                    self._running_since.pop(me, None)
                    item = self._next_task(me)
