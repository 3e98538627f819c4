"""A rank's collective backend and device: NCCL on its own GPU where CUDA is, gloo on the CPU elsewhere.

    backend, device = rank_device.pick(args.backend)     # before init_process_group
    dist.init_process_group(backend, ...)
    model = DDP(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)

"auto" (the default of the examples' `--backend`) is NCCL when CUDA is available, else gloo; on a
host whose PCI bus shows NVIDIA GPUs while CUDA is unavailable it refuses instead of training on
the CPU (GPU hosts fail closed: DESIGN.md). The GPU is the one torchrun's LOCAL_RANK names.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BACKENDS = ("auto", "nccl", "gloo")
NVIDIA_VENDOR = "0x10de"
PCI_DEVICES = Path("/sys/bus/pci/devices")


class NoDevice(RuntimeError):
    """The backend asked for cannot run here (or a GPU host cannot reach its GPUs)."""


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="collective backend: auto (default) = nccl on CUDA (the rank's LOCAL_RANK GPU), gloo on CPU",
    )


def nvidia_gpus_on_pci(root: Path = PCI_DEVICES) -> list[str]:
    """The bus ids of NVIDIA display/3D controllers (PCI class 0x03xxxx) on this host."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for dev in entries:
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            cls = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and cls.startswith("0x03"):
            found.append(dev.name)
    return found


def pick(
    choice: str = "auto", env: Mapping[str, str] | None = None, pci: Path = PCI_DEVICES
) -> tuple[str, Any]:
    """(backend, torch.device) for this rank; sets the current CUDA device under NCCL."""
    import torch

    env = os.environ if env is None else env
    if choice not in BACKENDS:
        raise NoDevice(f"backend: one of {', '.join(BACKENDS)}, got {choice!r}")
    cuda = torch.cuda.is_available()
    if choice == "auto":
        gpus = [] if cuda else nvidia_gpus_on_pci(pci)
        if gpus:
            raise NoDevice(
                f"{len(gpus)} NVIDIA GPU(s) on the PCI bus ({', '.join(gpus[:4])}) but CUDA is not "
                "available: not training on the CPU of a GPU host (--backend gloo forces it)"
            )
        choice = "nccl" if cuda else "gloo"
    if choice == "gloo":
        return "gloo", torch.device("cpu")
    if not cuda:
        raise NoDevice("--backend nccl: CUDA is not available on this host")
    local = env.get("LOCAL_RANK", "0")
    index = int(local) if local.isdigit() else 0
    if index >= torch.cuda.device_count():
        raise NoDevice(f"LOCAL_RANK {index}: only {torch.cuda.device_count()} CUDA device(s) visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return "nccl", device
