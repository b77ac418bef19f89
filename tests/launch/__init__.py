"""Tests of `workbench.launch`: N ranks."""
