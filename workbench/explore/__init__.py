"""Looking inside checkpoints: the `Checkpoint` view, stats, diffs, plots, verify, checksums."""
