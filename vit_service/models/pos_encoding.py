"""Positional encodings: fixed sinusoidal tables (Vaswani et al. 2017) or learned parameters.

Both expose the table as ``pos_embed`` of shape ``(1, T, D)`` so that the ViT's state dict keeps
timm's key ``pos_embed`` whichever encoding is chosen (the sinusoidal table is a persistent
buffer, the learned one a parameter).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

PosEncoding = Literal["sinusoidal", "learned", "none"]


def sinusoidal_table(num_positions: int, dim: int, base: float = 10000.0,
                     stride: float = 1.0) -> Tensor:
    """``PE(pos, 2i) = sin(pos / base^(2i/d))``, ``PE(pos, 2i+1) = cos(pos / base^(2i/d))``.

    ``stride`` != 1 places position ``t`` at the centre of a cell ``stride`` wide,
    ``pos = (t + 0.5) * stride - 0.5``: a coarser grid over the same extent (a 4-wide grid with
    stride 2 sits at 0.5, 2.5, 4.5, 6.5 of the 8-wide one). Returns ``(num_positions, dim)``.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal encoding needs an even dim, got {dim}")
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (T, 1)
    if stride != 1.0:
        pos = (pos + 0.5) * stride - 0.5
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (D/2,)
    angle = pos / base ** (two_i / dim)  # (T, D/2)
    pe = torch.zeros(num_positions, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


def sinusoidal_table_2d(grid_h: int, grid_w: int, dim: int, base: float = 10000.0,
                        stride: tuple[float, float] = (1.0, 1.0)) -> Tensor:
    """2-D sin-cos over a patch grid: half the channels encode the row, half the column.

    ``stride``: cells per row / column of the grid the table was made for (see
    :func:`sinusoidal_table`), for a coarser grid over the same image. Returns
    ``(grid_h * grid_w, dim)`` in row-major patch order (the order of the patch conv).
    """
    if dim % 4:
        raise ValueError(f"2-D sinusoidal encoding needs dim divisible by 4, got {dim}")
    rows = sinusoidal_table(grid_h, dim // 2, base, stride[0])  # (Gh, D/2)
    cols = sinusoidal_table(grid_w, dim // 2, base, stride[1])  # (Gw, D/2)
    pe = torch.cat(
        [
            rows[:, None, :].expand(grid_h, grid_w, dim // 2),
            cols[None, :, :].expand(grid_h, grid_w, dim // 2),
        ],
        dim=-1,
    )  # (Gh, Gw, D)
    return pe.reshape(grid_h * grid_w, dim)


def register_pos_embed(
    module: nn.Module, kind: PosEncoding, num_positions: int, dim: int,
    table: Tensor | None = None,
) -> None:
    """Give ``module`` a ``pos_embed`` of shape ``(1, T, D)``, added to its ``(B, T', D)`` tokens.

    * ``sinusoidal``: fixed persistent buffer (not trained) holding ``table`` (default: the 1-D
      2017 table);
    * ``learned``: parameter, truncated-normal init (std 0.02, as in ViT/BERT);
    * ``none``: a zero buffer (ablations, the permutation-equivariance test).

    Registered under the same name in every case so state-dict keys do not depend on the choice
    (timm's ViT key ``pos_embed``).
    """
    if kind == "learned":
        module.pos_embed = nn.Parameter(torch.empty(1, num_positions, dim))
        nn.init.trunc_normal_(module.pos_embed, std=0.02, a=-0.04, b=0.04)  # cut at 2 std
        return
    if kind == "sinusoidal":
        table = sinusoidal_table(num_positions, dim) if table is None else table
    elif kind == "none":
        table = torch.zeros(num_positions, dim)
    else:
        raise ValueError(f"unknown pos_encoding {kind!r}; use sinusoidal, learned or none")
    if tuple(table.shape) != (num_positions, dim):
        raise ValueError(f"table shape {tuple(table.shape)} != {(num_positions, dim)}")
    module.register_buffer("pos_embed", table[None].clone(), persistent=True)


def resample_grid_pos_embed(
    pos_embed: Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1
) -> Tensor:
    """Bicubically resize a learned ``(1, P + Gh*Gw, D)`` table to a new patch grid."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old = int(math.isqrt(grid.shape[1]))
    if old * old != grid.shape[1]:
        raise ValueError(f"cannot infer a square grid from {grid.shape[1]} positions")
    d = grid.shape[-1]
    grid = grid.reshape(1, old, old, d).permute(0, 3, 1, 2)  # (1, D, G, G)
    grid = nn.functional.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d)  # (1, G'*G', D)
    return torch.cat([prefix, grid], dim=1)
