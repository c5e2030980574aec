"""Host-to-device copies that never synchronize the device (the plan's tensors, the cuDNN
call layouts, the loss's agreement scalars)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """Host tensor -> ``device`` without a device sync: on CUDA through a pinned copy, non
    blocking (torch's pinned allocator keeps that copy alive until the transfer is done; a
    plain ``.to(device)`` of pageable memory synchronizes the stream). None stays None."""
    device = torch.device(device)
    if t is None or t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
