"""What the test tiers share: nodes and their faults (``agents``), what a run left behind
(``records``), real servers (``prometheus_server``, ``tls_pki``), trainer configurations
(``configs``) and whether this is CI (``ci``). Waiting is
:func:`elastic_trainer.ops.processes.wait_for`, the product's own."""
