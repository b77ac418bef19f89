"""Training checkpoints: Lightning views and the selection of model weights out of training state."""
