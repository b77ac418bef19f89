"""Tests of `workbench.cli`: the `workbench` command."""
