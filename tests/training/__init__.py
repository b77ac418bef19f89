"""Tests of `workbench.training`: training-state selection."""
