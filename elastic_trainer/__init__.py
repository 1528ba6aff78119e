"""elastic-trainer: fault-tolerant, elastic PyTorch DDP training."""

__version__ = "0.1.0"
