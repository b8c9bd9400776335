"""Script-level tests: unchanged SMP-style scripts launched as real jobs (torchrun, CPU, gloo)."""
