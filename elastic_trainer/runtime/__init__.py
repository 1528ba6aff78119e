"""Worker-process primitives any training loop needs, the runtime's own loop or yours.

Runs in: every worker process (started by torchrun). Process group set-up, per-step random
streams, the elastic sampler, graceful-stop signals, failure classification and the worker's
settings; ``torch_compat`` holds every private torch use of the package (the launcher and
``status`` import it too). Imports nothing from ``launch``, ``ops`` or ``doctor``.
"""
