"""hybridmon agent: sampling loop, history, exposition, API and CLI."""

from hybridmon import __version__  # noqa: F401 (kept for callers of hybridmon.agent.__version__)
