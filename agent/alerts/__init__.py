"""Alert families: one module per kind of trouble (family.py says what one holds) and the
catalogue that lists them (catalogue.py)."""
