"""Who owns checkpointing: files, the manager, the just-in-time save, and their inspection.

Runs in: the worker processes (``manager``, ``jit``, ``files``), and the operator's shell
(``catalog``: ``elastic-trainer checkpoint list|verify|inspect``).
"""
