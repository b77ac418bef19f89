"""Tests of `workbench.widgets`, driven in plain pytest (the browser tests are in tests/browser/)."""
