"""Slow end-to-end suites: crash safety, torchrun and multinode runs, transformers round trips, benchmarks, samples, the hostile corpus."""
