"""Tests of `workbench.output`: the output formats and destinations."""
