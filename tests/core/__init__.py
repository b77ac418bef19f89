"""Tests of the top-level modules (catalog, dtypes, errors, names, display, files, overflow) and of the package's shape."""
