"""``python -m elastic_trainer.doctor``: what ``elastic-trainer doctor`` starts on every rank."""

from elastic_trainer.doctor.main import run_main

run_main()
