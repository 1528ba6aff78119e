"""The exit statuses of a worker, and so of ``elastic-trainer run`` and torchrun's record of it.

Named once here; the launcher's failure policy, the loops and the just-in-time save use these
names. A graceful stop exits non-zero on purpose, so that torchrun restarts or ends the group.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
"""The run finished."""
EXIT_FAILED = 1
"""A failure a restart may heal (a peer died, a collective timed out)."""
EXIT_DETERMINISTIC = 2
"""A failure no restart can fix: a mistake (the usage-error convention)."""
EXIT_STOPPED = 128 + signal.SIGTERM
"""After a graceful stop, or a just-in-time save on the signal path (143, as a SIGTERM's)."""
