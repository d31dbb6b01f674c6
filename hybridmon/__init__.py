"""hybridmon: observability and diagnostics for hybrid GPU/CPU inference hosts.

The installed distribution has this one import package. Its subpackages live in the repository's
top-level folders (agent/, exporters/, rules/, dashboards/, runbooks/) and are mapped under
`hybridmon.` by pyproject.toml's package-dir, so `pip install .` (and `pip install -e .`) put
nothing else at the top of site-packages.
"""

__version__ = "0.1.0"
