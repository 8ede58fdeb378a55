"""The environment of a process the daemon starts (a job's worker, a serving process).

Both run code from user-supplied model folders, so they get none of the daemon's secrets
(`RP_TOKEN`: whoever holds it drives the whole API); both must import this copy of the
package, and write their logs unbuffered (a crash loses no line).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SECRET_ENV", "child_env"]

SECRET_ENV = frozenset({"RP_TOKEN"})
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def child_env() -> dict[str, str]:
    """The daemon's environment less its secrets, with this package first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    return env
