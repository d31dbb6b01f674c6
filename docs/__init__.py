"""The documentation; generate.py rewrites the parts of it derived from the code."""
