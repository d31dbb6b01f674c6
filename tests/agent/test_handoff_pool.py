"""The collectors' pool: one thread runs a tick's tasks in order; a hung task hands the queue on."""
import threading
import time

import pytest

from hybridmon.agent.loop.handoff_pool import HandoffPool

HANDOFF = 0.1


def wait_for(condition, seconds=3.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_quick_tasks_run_in_order_on_one_thread_however_many_ticks():
    pool = HandoffPool(12, HANDOFF, "collector")
    ran = []
    for tick in range(30):
        for collector in range(12):
            pool.submit(lambda t=tick, c=collector: ran.append((t, c, threading.get_ident())))
        assert wait_for(lambda: len(ran) == 12 * (tick + 1))
    assert [(t, c) for t, c, _ in ran] == [(t, c) for t in range(30) for c in range(12)]
    assert len({ident for _, _, ident in ran}) <= 2  # the runner, and the standby where it won a race
    assert pool.threads == 2                          # never one per collector
    pool.shutdown()


def test_a_hung_task_holds_the_others_up_by_the_handoff_only():
    pool = HandoffPool(4, HANDOFF, "collector")
    release = threading.Event()
    hung_on = []
    done = {}
    pool.submit(lambda: (hung_on.append(threading.get_ident()), release.wait(5)))
    queued_at = time.monotonic()
    for name in ("host_memory", "process", "pressure"):
        pool.submit(lambda n=name: done.__setitem__(n, (time.monotonic(), threading.get_ident())))
    assert wait_for(lambda: len(done) == 3, seconds=2.0)
    waited = max(at for at, _ in done.values()) - queued_at
    assert HANDOFF * 0.9 <= waited < HANDOFF + 0.5
    assert {ident for _, ident in done.values()} == {done["process"][1]} != set(hung_on)
    release.set()
    pool.shutdown()


def test_every_task_hung_takes_a_thread_each_up_to_max_workers():
    pool = HandoffPool(3, HANDOFF, "collector")
    release = threading.Event()
    started = []
    for _ in range(4):
        pool.submit(lambda: (started.append(threading.get_ident()), release.wait(5)))
    assert wait_for(lambda: len(started) == 3)
    time.sleep(HANDOFF * 3)
    assert len(started) == 3 and len(set(started)) == 3  # the fourth waits for a thread to return
    release.set()
    assert wait_for(lambda: len(started) == 4)
    pool.shutdown()


def test_a_failing_task_does_not_stop_the_ones_behind_it(caplog):
    pool = HandoffPool(2, HANDOFF, "collector")
    ran = []
    pool.submit(lambda: 1 / 0)
    pool.submit(lambda: ran.append("next"))
    assert wait_for(lambda: ran == ["next"])
    assert "collector task failed" in caplog.text
    pool.shutdown()


def test_shutdown_drops_the_queue_and_refuses_more_and_the_threads_do_not_hold_up_exit():
    pool = HandoffPool(2, 5.0, "collector")
    release = threading.Event()
    ran = []
    pool.submit(release.wait, 5)
    pool.submit(lambda: ran.append("queued"))
    assert wait_for(lambda: pool.threads >= 1)
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    release.set()
    time.sleep(0.1)
    assert ran == []
    assert all(thread.daemon for thread in pool._threads)


@pytest.mark.parametrize("workers, handoff", [(0, 0.1), (2, 0.0)])
def test_bad_settings_are_refused(workers, handoff):
    with pytest.raises(ValueError, match="max_workers"):
        HandoffPool(workers, handoff, "collector")
