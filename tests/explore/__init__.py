"""Tests of `workbench.explore`: the `Checkpoint` view."""
