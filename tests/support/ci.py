"""Whether this is CI: there a test that needs a real component never skips, a missing one fails.

CI sets ``CI=true`` (``.ci/run``); every fixture that would skip for a missing binary (etcd,
Prometheus, openssl, tmux, root for network namespaces) fails instead when :data:`IN_CI`.
"""

from __future__ import annotations

import os

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
