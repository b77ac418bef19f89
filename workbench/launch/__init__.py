"""N ranks: torchrun, the local launcher, the worker entry point, job folders, in place under torchrun."""

from .launcher import Launch, launch

__all__ = ["Launch", "launch"]
