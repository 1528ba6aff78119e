"""``elastic-trainer doctor``: checks of the distributed set-up, run on every rank.

Runs in: worker processes that ``elastic-trainer doctor`` launches (``python -m elastic_trainer.doctor``).
Design: ``docs/design/doctor.md``.
"""
