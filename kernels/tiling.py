"""Tile order shared by the Triton GEMM (``nvfp4_gemm``) and the Gluon SM90 GEMM (``nvfp4_gemm_sm90``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """Program id -> (token tile, weight tile). GROUP_N weight tiles take consecutive ids, walked for every token
    tile before the next group, so CTAs running at the same time share X and W tiles in L2. Also used by the Gluon
    SM90 kernel, which is why it lives apart from both."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_N * num_pid_m
    first_n = (pid // group_size) * GROUP_N
    group_n = min(num_pid_n - first_n, GROUP_N)
    return (pid % group_size) // group_n, first_n + (pid % group_size) % group_n
