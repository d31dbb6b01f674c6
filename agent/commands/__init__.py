"""The one-shot commands behind agent/cli.py: `hybridmon check` (check.py), `hybridmon bench`
(bench.py, over agent/bench/), `hybridmon budget` (budget.py), the files `hybridmon
rules|dashboards|runbooks` print (shipped.py), and the live progress line they share
(progress.py)."""
