"""The one `device` choice made at the edge (`--device auto|cpu|cuda|cuda:N`) and what flows
down from it: weights, caches, step tensors and sampling all live on the resolved device; the
scheduler stays on the CPU and sends its indices over once per step (`to_device`)."""

from __future__ import annotations

import torch

from k3ray.device_flags import DEVICE_CHOICES

DeviceLike = str | torch.device | None


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """"auto" (or None): CUDA when available, else the CPU; "cpu"; "cuda" (the current CUDA device);
    "cuda:N". Always returns a torch.device with an index for CUDA. ValueError for anything else,
    and for CUDA asked on a machine without it."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}") from e
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asks for CUDA, but torch {torch.__version__} sees no CUDA device "
                         "on this machine; use --device cpu (or auto)")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer index tensors -> the same tensors (int64) on `device`, in one host-to-device
    copy (through pinned memory, non-blocking) when the device is not the CPU."""
    longs = [t.long() for t in tensors]
    if device.type == "cpu":
        return longs
    flat = torch.cat([t.reshape(-1) for t in longs]) if longs else torch.zeros(0, dtype=torch.long)
    moved = flat.pin_memory().to(device, non_blocking=True)
    out, offset = [], 0
    for t in longs:
        out.append(moved[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
