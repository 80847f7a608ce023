"""References of the int4 format shared by the CPU tests (test_int4.py) and the Triton tests (test_int4_triton.py),
written out independently of fastdl: the nibble packing element by element, the exact dequantization in float64,
random codes and scales."""

import torch


def groups_for(K):
    """The group sizes that divide K."""
    return [g for g in (32, 64, 128) if K % g == 0]


def pack_ref(u: torch.Tensor) -> torch.Tensor:
    """The contract's nibble order (llama.cpp's Q4_0), element by element: byte 16 b + i = u[32 b + i] |
    u[32 b + 16 + i] << 4."""
    N, K = u.shape
    out = torch.empty((N, K // 2), dtype=torch.uint8)
    for b in range(K // 32):
        for i in range(16):
            out[:, 16 * b + i] = u[:, 32 * b + i] | (u[:, 32 * b + 16 + i] << 4)
    return out


def dequant_ref(u, s, z, G) -> torch.Tensor:
    """W[n, k] = (u[n, k] - z[n, k // G]) * float32(s[n, k // G]), z = 8 without zeros, in float64 (exact)."""
    zz = torch.full(s.shape, 8.0, dtype=torch.float64) if z is None else z.double().cpu()
    s64 = s.float().double().cpu()
    return (u.double().cpu() - zz.repeat_interleave(G, dim=1)) * s64.repeat_interleave(G, dim=1)


def random_int4(N, K, G, zeros, seed=0):
    """Random codes u [N, K] (uint8, 0..15), float16 scales [N, K / G] (every third negative: the search's Q4_0-style
    orientation) and, with ``zeros``, uint8 zero points [N, K / G]."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s = (torch.rand(N, K // G, generator=g) * 0.02 + 0.001).half()
    s[:, ::3] = -s[:, ::3]
    z = torch.randint(0, 16, (N, K // G), generator=g, dtype=torch.uint8) if zeros else None
    return u, s, z
