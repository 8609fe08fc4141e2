"""DFlash2's grouped dynamic causal convolution, as the engine computes it (the golden definition).

Around each draft sublayer (attention, MLP) a DFlash2 layer convolves the block along its slots with
`kernel_size` causal taps: slot `s` of the output is `sum_t x[s - t] * (base[t] + delta[s, t])`, where `base[t]`
is a learned per-channel kernel and `delta[s, t]` a per-group coefficient projected from the sublayer's (normed)
input at slot `s`, shared by the `group_size` channels of a group. Slots before the block's first contribute
nothing. One projection gives both convolutions' coefficients: the one before the sublayer convolves its input,
the one after convolves its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BEFORE, AFTER = 0, 1  # rows of base_kernel and of the projected coefficients


@dataclass
class GroupedDynamicConv:
    """One sublayer's pair of convolutions: `base_kernel [2, K, H]`, `projection [2 * K * G, H]`."""

    base_kernel: torch.Tensor
    projection: torch.Tensor
    group_size: int

    @property
    def kernel_size(self) -> int:
        return self.base_kernel.shape[1]

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic coefficients `[b, slots, 2, K, groups]` from the sublayer's input `[b, slots, H]`."""
        groups = x.shape[-1] // self.group_size
        return F.linear(x, self.projection).view(*x.shape[:-1], 2, self.kernel_size, groups)

    def convolve(self, x: torch.Tensor, coefficients: torch.Tensor, which: int) -> torch.Tensor:
        """`x [b, slots, H]` convolved along its slots with kernel `which` (BEFORE or AFTER)."""
        batch, slots, hidden = x.shape
        groups = hidden // self.group_size
        grouped = x.view(batch, slots, groups, self.group_size)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            shifted = grouped if tap == 0 else F.pad(grouped[:, : slots - tap], (0, 0, 0, 0, tap, 0))
            base = self.base_kernel[which, tap].to(x.dtype).view(1, 1, groups, self.group_size)
            out = out + shifted * (base + coefficients[:, :, which, tap, :, None])
        return out.view(batch, slots, hidden)
