"""The status page served at GET / (page.py): findings, then per GPU, watched process, host and
inference server the signals behind them (signals.py, inference.py) with their last hour
(trends.py, plots.py), in one self-contained HTML page (template.py)."""
