"""Core tests run tiny tensors; one intra-op thread avoids OpenMP contention
(on a busy 2-core machine, tiny ops with 2 threads run ~100x slower)."""
import torch

torch.set_num_threads(1)
