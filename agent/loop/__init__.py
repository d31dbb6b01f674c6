"""The sampling loop and what it fills: collectors built and scheduled (wiring.py, sampler.py),
the bounded history (history.py), trace files for record and replay (trace.py), and whether the
loop is alive (liveness.py)."""
