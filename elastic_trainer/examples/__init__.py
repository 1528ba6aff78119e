"""Built-in example jobs (no downloads), e.g. ``python -m elastic_trainer.examples.synthetic_cnn``."""
