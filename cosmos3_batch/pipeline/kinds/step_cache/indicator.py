"""SeaCache's spectral indicator on an accelerator without a host read.

diffusers' `_apply_sea_filter` (hooks/sea_cache.py) normalizes its gain by the gain's mean inside
`if torch.isfinite(mean_gain) and mean_gain > 0`: on a GPU that is a device-to-host read per forward, which
the pass loop must not pay per request (one read per pass, for all of a rank's gates: step_cache.gate_rank).
This is the same function with that branch taken on the device (`torch.where`): every other op, its order
and its dtypes are diffusers'. On CPU the pipeline calls diffusers' own `_build_indicator`;
tests/unit/test_sea_cache.py holds this equal to it bit for bit and pins its source.
"""

from __future__ import annotations

import torch


def device_indicator(raw: torch.Tensor, sigma: float, power_exp: float) -> torch.Tensor:
    """`_build_indicator` of one latent [C, T, H, W]: the filter over (T, H, W), channels last."""
    hidden_states = raw.movedim(0, -1)
    dtype = hidden_states.dtype
    hidden_states = hidden_states.contiguous().float()
    dimensions = (0, 1, 2)
    spectrum = torch.fft.fftn(hidden_states, dim=dimensions)
    sigma = max(1e-6, min(1.0 - 1e-6, sigma))
    signal_scale, noise_scale = 1.0 - sigma, sigma
    gain = None
    device = hidden_states.device
    for axis in dimensions:
        frequencies = torch.fft.fftfreq(hidden_states.shape[axis], device=device, dtype=torch.float32)
        clean_power = 1.0 / (frequencies.abs().pow(power_exp) + 1e-16)
        axis_gain = signal_scale * clean_power / (signal_scale**2 * clean_power + noise_scale**2 + 1e-16)
        axis_shape = [1] * hidden_states.ndim
        axis_shape[axis] = axis_gain.shape[0]
        gain = axis_gain.reshape(axis_shape) if gain is None else gain * axis_gain.reshape(axis_shape)
    mean_gain = gain.mean()
    usable = torch.isfinite(mean_gain) & (mean_gain > 0)
    gain = torch.where(usable, gain / mean_gain, gain)
    return torch.fft.ifftn(spectrum * gain, dim=dimensions).real.to(dtype).detach()
