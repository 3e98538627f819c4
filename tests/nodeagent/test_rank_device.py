"""The examples' backend choice (nodeagent.trainer.rank_device): NCCL on the rank's GPU, gloo on CPU, and no
CPU fallback on a host whose PCI bus shows NVIDIA GPUs. CUDA is monkeypatched at torch's boundary
only in the test that says so (there is no GPU here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nodeagent.trainer import rank_device


def _pci(tmp: Path, *devices: tuple[str, str, str]) -> Path:
    for bus, vendor, cls in devices:
        d = tmp / bus
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    return tmp


def test_auto_on_a_cpu_host_is_gloo_on_the_cpu(tmp_path: Path) -> None:
    pci = _pci(tmp_path, ("0000:00:02.0", "0x8086", "0x030000"), ("0000:01:00.0", "0x10de", "0x040300"))
    assert not torch.cuda.is_available()
    assert rank_device.pick("auto", env={}, pci=pci) == ("gloo", torch.device("cpu"))
    assert rank_device.pick("gloo", env={}, pci=pci) == ("gloo", torch.device("cpu"))


def test_a_gpu_host_without_cuda_refuses_instead_of_training_on_the_cpu(tmp_path: Path) -> None:
    pci = _pci(tmp_path, ("0000:17:00.0", "0x10de", "0x030200"))
    assert rank_device.nvidia_gpus_on_pci(pci) == ["0000:17:00.0"]
    with pytest.raises(rank_device.NoDevice, match=r"1 NVIDIA GPU\(s\) on the PCI bus \(0000:17:00.0\)"):
        rank_device.pick("auto", env={}, pci=pci)
    with pytest.raises(rank_device.NoDevice, match="CUDA is not available"):
        rank_device.pick("nccl", env={}, pci=pci)


def test_with_cuda_auto_is_nccl_on_the_local_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert rank_device.pick("auto", env={"LOCAL_RANK": "1"}, pci=tmp_path) == (
        "nccl",
        torch.device("cuda", 1),
    )
    assert chosen == [torch.device("cuda", 1)]
    with pytest.raises(rank_device.NoDevice, match="LOCAL_RANK 2: only 2"):
        rank_device.pick("auto", env={"LOCAL_RANK": "2"}, pci=tmp_path)
