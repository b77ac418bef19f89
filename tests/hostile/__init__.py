"""Hostile inputs for the reliability tests: seed checkpoints, byte mutators, and a corpus of crafted files.

`seeds` writes one small, valid checkpoint per fuzz target; `fuzzing` mutates one file of it (driven by
hypothesis) and checks what the readers do with it; `corpus` builds the hand-made hostile cases of
`tests/system/test_hostile.py`. `benchmarks/fuzz_long.py` runs the same targets for longer.
"""
