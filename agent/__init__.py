"""hybridmon agent: the daemon assembled (daemon.py), its configuration and command line, and one
subpackage per concern:

- loop/: the sampling loop, the history it fills, traces (record and replay), liveness;
- detectors/: the engine that keeps findings' alert state, and the helpers alert families share;
- alerts/: one module per alert family, and the catalogue that finds them;
- publish/: what goes out of the assembled agent: exposition, findings, Alertmanager pushes;
- status/: the status page served at GET /;
- api/: the HTTP API over the running agent (and the runbooks it serves);
- commands/: `check`, `bench`, `budget`, and the files `rules|dashboards|runbooks` print;
- bench/: the offload benchmark: its CUDA source, build, runs and NUMA placement.

The agent's own series (loop, collectors, findings, Alertmanager delivery) are declared once, in
self_metrics.py.
"""
