"""Tests of `workbench.mapper`: the operation algebra and its presets."""
