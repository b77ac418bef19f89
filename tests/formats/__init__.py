"""Tests of `workbench.formats`: the readers, local and remote."""
