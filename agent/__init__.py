"""hybridmon agent: sampling loop, history, exposition, API and CLI."""

__version__ = "0.1.0"
