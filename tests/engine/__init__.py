"""Tests of `workbench.engine`: one rank's execution of a plan."""
