"""Host values to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable host memory, and CUDA synchronises the
stream before such a copy: the host waits for every kernel already queued. In the decode loop that
throws away the step of lookahead (the host preparing step t+1 while the device runs step t), and a
sampled batch used to pay it at every step for its temperatures. A copy from pinned memory with
`non_blocking=True` is queued behind those kernels instead; PyTorch's pinned-memory cache keeps
the buffer alive until the copy has landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(
    values: Sequence[Any] | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`values` (a list or a host tensor) as a tensor on `device`, queued without a host sync on CUDA."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
