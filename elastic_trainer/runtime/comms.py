"""The explicit context of one worker's runtime collectives: its abortable waits.

    comms = WorkerComms(waits=healer.waits)             # ElasticGroup builds one per worker run
    channel = ControlChannel(env, waits=comms.waits, carrier=carrier)

Before issue 30 this was a process-wide singleton (``WAITS``) that several modules flipped or
read; now whoever needs it is handed this object (the healer owns the waits), so a test or a
second group in one process cannot see another's state.

Nothing here touches DDP's buckets: DDP reduces them in C++ (no comm hook anywhere in the
package), the step's control travels on its own small host collective (or, on the CPU, as a
gradient in them: ``runtime/grad_carrier.py``), and a bucket wait that gloo leaves blocked after
an abort is ended by the healer's stop watch (``docs/design/heal-in-place.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_trainer.runtime.abortable import AbortableWaits


@dataclass(slots=True)
class WorkerComms:
    """What the runtime's waits on one worker's collectives share (see the module docstring)."""

    waits: AbortableWaits = field(default_factory=AbortableWaits)
    """Waits an abort can end (enabled by the healer on gloo/CPU; plain otherwise)."""
