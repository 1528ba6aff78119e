"""Which observer a worker uses: Prometheus metrics when the launcher collects them, else none.

Chosen once per run by either loop (``Elastic`` and the ``Trainer``), from the worker's settings.
"""

from __future__ import annotations

from elastic_trainer.runtime.failures import ConfigError
from elastic_trainer.runtime.observer import NullObserver, TrainingObserver
from elastic_trainer.runtime.settings import WorkerSettings


class MetricsSetupError(ConfigError):
    """Metrics were asked for (``ELASTIC_TRAINER_METRICS=1``) but cannot be provided here."""


def build_observer(settings: WorkerSettings | None = None) -> TrainingObserver:
    """The observer a worker should use: metrics when the launcher collects them
    (``ELASTIC_TRAINER_METRICS=1``), else none.

    Raises:
        MetricsSetupError: metrics were asked for but cannot be provided here.
    """
    settings = settings if settings is not None else WorkerSettings.from_environ()
    if not settings.metrics:
        return NullObserver()
    # Imported here: prometheus-client and the worker's collectors load only when metrics are on.
    try:
        from elastic_trainer.metrics.worker import MetricsError, worker_observer
    except ImportError as exc:
        raise MetricsSetupError(
            f"ELASTIC_TRAINER_METRICS=1 but elastic_trainer.metrics.worker cannot be imported ({exc}); "
            "unset ELASTIC_TRAINER_METRICS or install the metrics extra"
        ) from exc
    try:
        return worker_observer(settings)
    except MetricsError as exc:
        raise MetricsSetupError(str(exc)) from exc
