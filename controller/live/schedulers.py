"""`[controller] backend`: which scheduler places the node agents (controller/backends/base.py,
`Scheduler`). Each backend's own settings are its own TOML section (`[slurm]`, `[ray]`,
`[kubernetes]`), validated by that backend's `from_section`; a backend's module is imported only
when it is chosen, so a controller host without the `kubernetes` or `ray` package still starts."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from controller.backends.base import BackendError, Scheduler, StaticFleet
from runwarden.config import ConfigError

# backend name -> (module, class with `from_section(raw: dict, where: str) -> Scheduler`)
BACKENDS: dict[str, tuple[str, str] | None] = {
    "agents": None,
    "slurm": ("controller.backends.slurm", "SlurmScheduler"),
    "ray": ("controller.backends.ray", "RayScheduler"),
    "kubernetes": ("controller.backends.kubernetes", "KubernetesScheduler"),
}
SECTIONS = tuple(name for name, where in BACKENDS.items() if where is not None)


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"controller.backend: {name!r} is not one of {', '.join(BACKENDS)}")
    return name


def build_scheduler(name: str, section: dict[str, Any], where: str, *, run: str = "") -> Scheduler:
    """The chosen backend's scheduler from its section (ConfigError for a bad one). ``run`` is the
    controller's run name: a backend that names things after the run (JobSets, Slurm jobs, Ray
    placement groups) takes it as its default instead of a second copy in its section."""
    target = BACKENDS[check_backend(name)]
    if target is None:
        if section:
            raise ConfigError(f"{where}: the agents backend takes no settings")
        return StaticFleet()
    module_name, cls_name = target
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}: backend {name!r} needs {exc.name or exc}: install the {name} extra"
        ) from None
    factory = getattr(module, cls_name).from_section
    kwargs = {"run": run} if run and "run" in inspect.signature(factory).parameters else {}
    try:
        scheduler = factory(dict(section), where, **kwargs)
    except BackendError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    if not isinstance(scheduler, Scheduler):
        raise ConfigError(f"{where}: {cls_name} does not implement the Scheduler protocol")
    return scheduler
