"""Tests of `workbench.planning`: the dry-run plan."""
