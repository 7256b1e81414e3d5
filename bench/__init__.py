"""Side-by-side benchmark: direct vs relay vs nginx (see bench/__main__.py)."""
