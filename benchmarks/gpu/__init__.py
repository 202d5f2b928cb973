"""On a GPU machine: the prepared check of the CUDA/ROCm path (`check`), and checkpoints of GPU state."""
