"""The tests of the server_crash alert family (agent/alerts/server_crash.py): its detector, on
histories written sample by sample as the collectors write them (the process collector's exit and
OOM-kill counters per identity, exporters/process.py), and its rules' promtool cases."""
from __future__ import annotations

from hybridmon.agent.alerts import server_crash
from hybridmon.exporters import gpu, host_memory, process
from tests.support.detector_history import (GIB, T0, THRESHOLDS, Trace, assert_says_its_rules_words, gpu_rows,
                                            host_memory_rows)
from tests.support.promtool_cases import GPU0, ONSET, STEP, Test

SETTINGS = THRESHOLDS.server_crash
VLLM = ("python3", "vllm", "mistral-7b")            # process_name, server, model
IDENTITY = dict(zip(server_crash.IDENTITY, VLLM))


def detector():
    return server_crash.Detector(SETTINGS)


def crash_rows(t: float, *, exits_at=(), oom_at=(), host_oom_at=(), pid_of=lambda t: "4242",
               h2d: float = 20e9, utilization: float = 0.9, available: float = 32 * GIB,
               used: float = 20 * GIB, on_gpu: bool = True):
    """One tick: vLLM (its pid changes at each restart) on GPU 0, its exit and OOM counters, the
    host's oom_kill. A killed process's own series stop; the new one's start."""
    exits = sum(1 for at in exits_at if t >= at)
    killed = sum(1 for at in oom_at if t >= at)
    pid = pid_of(t)
    rows = [(process.EXITS, exits, *VLLM), (process.OOM_KILLED, killed, *VLLM),
            (process.INFO, 1, pid, VLLM[0], "python3", VLLM[1], VLLM[2], "config", pid)]
    rows += host_memory_rows(memory_available=available)
    rows.append((host_memory.OOM_KILLS, 3 + sum(1 for at in host_oom_at if t >= at)))
    rows += gpu_rows(h2d=h2d, d2h=1e9, utilization=utilization, used=used,
                     processes={pid: (VLLM[0], used - GIB)} if on_gpu else None)
    return rows


def run(trace_end: float, **story):
    trace = Trace()
    trace.run(T0, trace_end, gpu=lambda t: crash_rows(t, **story))
    return trace.history


def by_alert(findings):
    return {(f.alertname, tuple(sorted(f.labels.items()))): f for f in findings}


def test_the_server_killed_by_the_oom_killer_is_named_with_what_preceded_it():
    """At T0+300 the server is OOM-killed after a minute of a full link (25.8 GB/s host to device,
    82 % of Gen4 x16's 31.5 GB/s, past the 25.5 GB/s copies achieve) and MemAvailable falling to
    0.5 GiB; the host counts the kill too."""
    trace = Trace()
    trace.run(T0, T0 + 320, gpu=lambda t: crash_rows(
        t, exits_at=[T0 + 300], oom_at=[T0 + 300], host_oom_at=[T0 + 300],
        pid_of=lambda t: "4242" if t < T0 + 300 else "4300",
        h2d=25.8e9 if t >= T0 + 230 else 10e9, utilization=0.2 if t >= T0 + 230 else 0.9,
        available=0.5 * GIB if t >= T0 + 280 else 20 * GIB))
    findings = detector().evaluate(trace.history, T0 + 310)
    found = by_alert(findings)
    assert set(found) == {("InferenceServerOomKilled", tuple(sorted(IDENTITY.items()))), ("HostOomKill", ())}
    killed = found[("InferenceServerOomKilled", tuple(sorted(IDENTITY.items())))]
    assert killed.severity == "critical" and killed.value == 1
    assert killed.summary.startswith("python3 (vllm) serving mistral-7b on ")
    assert "Its GPU's PCIe link ran up to" in killed.description
    assert killed.values["link"] > 0.9          # the fuller direction against the achievable 25.5 GB/s
    assert killed.values["available"] == 0.5 * GIB
    assert killed.values["vram_free"] == 24 * GIB - 20 * GIB
    assert "Host memory available fell to 512MiB." in killed.description
    assert "unknown" not in killed.description
    host = found[("HostOomKill", ())]
    assert "Watched inference processes among them: 1 " in host.description
    for each in findings:
        assert_says_its_rules_words(each)
    # a minute after the kill, it has been said
    assert detector().evaluate(trace.history, T0 + 300 + SETTINGS.window_seconds + 1) == []


def test_an_unrelated_oom_kill_is_the_hosts_alone():
    history = run(T0 + 200, host_oom_at=[T0 + 150])
    findings = detector().evaluate(history, T0 + 160)
    assert [f.alertname for f in findings] == ["HostOomKill"]
    assert "Watched inference processes among them: 0 " in findings[0].description
    assert_says_its_rules_words(findings[0])


def test_a_planned_restart_is_silent():
    history = run(T0 + 200, exits_at=[T0 + 150], pid_of=lambda t: "4242" if t < T0 + 150 else "4300")
    assert detector().evaluate(history, T0 + 160) == []


def test_three_exits_in_fifteen_minutes_are_a_crash_loop_two_are_not():
    exits = [T0 + 100, T0 + 400, T0 + 700]
    trace = Trace(retention_seconds=3600, interval_seconds=5)
    trace.run(T0, T0 + 1100, step=5, gpu=lambda t: crash_rows(t, exits_at=exits, oom_at=exits[:2],
                                                              host_oom_at=exits[:2]))
    loop = [f for f in detector().evaluate(trace.history, T0 + 705) if f.alertname == "InferenceServerCrashLooping"]
    assert [(f.labels, f.value, f.severity) for f in loop] == [(IDENTITY, 3, "warning")]
    assert "exited 3 times in the last 15m" in loop[0].description
    assert "The OOM killer caused 2 of them." in loop[0].description
    assert_says_its_rules_words(loop[0])
    assert not [f for f in detector().evaluate(trace.history, T0 + 695) if f.alertname == "InferenceServerCrashLooping"]
    # the first exit leaves the 15 min window
    assert not [f for f in detector().evaluate(trace.history, T0 + 100 + SETTINGS.restart_window_seconds + 5)
                if f.alertname == "InferenceServerCrashLooping"]


def test_a_figure_never_measured_leaves_its_clause_out():
    """No GPU process series (a CPU-only server) and no swap counter: no link, VRAM or swap clause,
    and never "unknown"."""
    trace = Trace()
    trace.run(T0, T0 + 200, gpu=lambda t: [row for row in crash_rows(t, exits_at=[T0 + 150], oom_at=[T0 + 150],
                                                                     on_gpu=False)
                                           if row[0] is not host_memory.SWAP_IN_BYTES])
    (killed,) = [f for f in detector().evaluate(trace.history, T0 + 160) if f.alertname == "InferenceServerOomKilled"]
    assert "PCIe link ran" not in killed.description and "VRAM free" not in killed.description
    assert "Swap-in" not in killed.description and "unknown" not in killed.description
    assert "Host memory available fell to 32GiB." in killed.description
    assert_says_its_rules_words(killed)


# --- its rules' promtool cases -------------------------------------------------------------------

def promtool_cases(t, catalog) -> list[Test]:
    killed_rule, loop_rule = catalog.find("InferenceServerOomKilled"), catalog.find("InferenceServerCrashLooping")
    host_rule = catalog.find("HostOomKill")
    identity = {"process_name": "python3", "server": "vllm", "model": "mistral-7b"}
    after = ONSET + STEP            # the counters' first sample after the kill
    steps = (ONSET + 600) // STEP + 1

    def counter(first_step: int, *rises_at: int) -> list[float]:
        return [float(sum(1 for at in rises_at if i * STEP >= at)) for i in range(first_step, steps)]

    killed = Test("server crash: vLLM OOM-killed after a full link and MemAvailable falling; the host "
                  "counts the kill", ONSET + 600, catalog)
    killed.values(process.OOM_KILLED.name, counter(0, after), **identity)
    killed.values(process.EXITS.name, counter(0, after), **identity)
    killed.values(host_memory.OOM_KILLS.name, [3 + v for v in counter(0, after)])
    killed.gauge(host_memory.MEMORY_AVAILABLE.name, 20 * GIB, 0.5 * GIB)
    # its pid held 20 GiB of GPU 0 until the kill; gpu:..traffic_share comes from the recordings
    killed.gauge(process.INFO.name, 1, None, pid="4242", process_name="python3", executable="python3",
                 server="vllm", model="mistral-7b", watch_reason="config", root_pid="4242")
    killed.gauge(gpu.PROCESS_MEMORY_USED.name, 20 * GIB, None, **GPU0, pid="4242", process_name="python3")
    killed.constant(gpu.MEMORY_USED.name, 21 * GIB, **GPU0)
    killed.constant(gpu.MEMORY_TOTAL.name, 24 * GIB, **GPU0)
    killed.expect(ONSET, killed_rule.alert)
    killed.expect(ONSET + 60, killed_rule.alert, killed.alert(
        killed_rule, identity, value=1, vram_free=3 * GIB, available=0.5 * GIB, link=None, swap_in=None))
    killed.expect(ONSET + 60, host_rule.alert, killed.alert(host_rule, {}, value=1, watched=1,
                                                            available=0.5 * GIB, swap_in=None))
    killed.expect(ONSET + 120, killed_rule.alert)  # said once: the kill has left the minute

    unrelated = Test("server crash: an unwatched process OOM-killed: the host's alert alone",
                     ONSET + 600, catalog)
    unrelated.values(process.OOM_KILLED.name, counter(0), **identity)
    unrelated.values(process.EXITS.name, counter(0), **identity)
    unrelated.values(host_memory.OOM_KILLS.name, [3 + v for v in counter(0, after)])
    unrelated.constant(host_memory.MEMORY_AVAILABLE.name, 8 * GIB)
    unrelated.expect(ONSET + 60, killed_rule.alert)
    unrelated.expect(ONSET + 60, host_rule.alert, unrelated.alert(host_rule, {}, value=1, watched=0,
                                                                  available=8 * GIB, swap_in=None))

    loop = Test("server crash: three exits in 15 min (two OOM kills) are a crash loop; two are not",
                ONSET + 600, catalog)
    exits = (after, ONSET + 240, ONSET + 480)
    loop.values(process.EXITS.name, counter(0, *exits), **identity)
    loop.values(process.OOM_KILLED.name, counter(0, *exits[:2]), **identity)
    loop.expect(ONSET + 420, loop_rule.alert)
    loop.expect(ONSET + 540, loop_rule.alert, loop.alert(loop_rule, identity, value=3, oom_killed=2,
                                                         available=None, swap_in=None, link=None,
                                                         vram_free=None))
    return [killed, unrelated, loop]
