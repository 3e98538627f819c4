"""Scheduler backends: the contract (``base``) and its implementations.

``slurm`` needs only Slurm's command-line tools; ``kubernetes`` needs the ``kubernetes`` client
package and is imported only when chosen, so a controller host without it still starts.
"""

from controller.backends.base import (
    Allocation,
    AttemptHandle,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Backend,
    BackendError,
)

__all__ = [
    "Allocation",
    "AttemptHandle",
    "AttemptSpec",
    "AttemptState",
    "AttemptStatus",
    "Backend",
    "BackendError",
]
