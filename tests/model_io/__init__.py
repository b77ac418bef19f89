"""Tests of `workbench.model_io`: `load_into` / `save_from` on one process."""
