"""Pickles read without executing them: the inert unpickler and its bounds."""
