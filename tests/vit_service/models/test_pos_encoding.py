import math

import pytest
import torch

from vit_service.models import create_model
from vit_service.models.pos_encoding import sinusoidal_table, sinusoidal_table_2d


def test_sinusoidal_table_matches_the_formula() -> None:
    T, d = 50, 16
    pe = sinusoidal_table(T, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_2d_table_encodes_row_and_column() -> None:
    pe = sinusoidal_table_2d(4, 4, 16).reshape(4, 4, 16)
    row_half, col_half = pe[..., :8], pe[..., 8:]
    # the row half is constant along a row, the column half constant along a column
    assert torch.allclose(row_half[2, 0], row_half[2, 3])
    assert torch.allclose(col_half[0, 1], col_half[3, 1])
    torch.testing.assert_close(row_half[1, 0], sinusoidal_table(4, 8)[1])
    # all 16 positions distinct
    flat = pe.reshape(16, 16)
    assert torch.cdist(flat, flat).add(torch.eye(16)).min() > 0.1


@pytest.mark.parametrize("name", ["vit_test", "text_test"])
def test_sinusoidal_is_a_fixed_buffer_learned_is_trainable(name: str) -> None:
    sin = create_model(name, pos_encoding="sinusoidal")
    learned = create_model(name, pos_encoding="learned")
    assert "pos_embed" in dict(sin.named_buffers())
    assert "pos_embed" not in dict(sin.named_parameters())
    assert "pos_embed" in sin.state_dict()  # same key either way (checkpoint compatibility)
    p = dict(learned.named_parameters())["pos_embed"]
    assert p.requires_grad
    # truncated-normal init: small, non-zero, bounded by 2 std
    assert 0.005 < p.std().item() < 0.03 and p.abs().max().item() <= 0.04 + 1e-6
    # a gradient step changes it
    x = torch.randn(2, 3, 32, 32) if name.startswith("vit") else torch.randint(5, 1000, (2, 12))
    learned(x).sum().backward()
    assert p.grad is not None and p.grad.abs().sum() > 0


def test_vit_sinusoidal_table_is_2d_with_zero_cls() -> None:
    m = create_model("vit_test", pos_encoding="sinusoidal")
    pe = m.pos_embed[0]  # (1 + N, D)
    assert torch.all(pe[0] == 0)
    torch.testing.assert_close(pe[1:], sinusoidal_table_2d(4, 4, 32))


@pytest.mark.parametrize("kind", ["sinusoidal", "learned"])
def test_positions_break_permutation_equivariance(kind: str) -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pos_encoding=kind, pool="mean").eval()
    ids = torch.randint(5, 1000, (1, 12))
    perm = torch.randperm(11) + 1
    shuffled = torch.cat([ids[:, :1], ids[:, perm]], 1)
    assert not torch.allclose(m(ids), m(shuffled), atol=1e-4)


def test_without_positions_text_model_is_permutation_invariant() -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pos_encoding="none", pool="mean").eval()
    ids = torch.randint(5, 1000, (1, 12))
    perm = torch.randperm(12)
    torch.testing.assert_close(m(ids), m(ids[:, perm]), atol=1e-5, rtol=0)


def test_a_strided_table_sits_at_the_coarse_cells_centres() -> None:
    d = 16
    coarse = sinusoidal_table(4, d, stride=2.0)  # cells 0.5, 2.5, 4.5, 6.5 of an 8-wide grid
    for t, pos in enumerate((0.5, 2.5, 4.5, 6.5)):
        i = torch.arange(d // 2, dtype=torch.float64)
        angle = pos / 10000 ** (2 * i / d)
        torch.testing.assert_close(coarse[t, 0::2], torch.sin(angle).float())
        torch.testing.assert_close(coarse[t, 1::2], torch.cos(angle).float())
    torch.testing.assert_close(sinusoidal_table(4, d, stride=1.0), sinusoidal_table(4, d))


def test_a_coarse_2d_grid_lies_between_the_full_grid_cells_it_covers() -> None:
    d = 64
    full = sinusoidal_table_2d(8, 8, d).reshape(8, 8, d)
    coarse = sinusoidal_table_2d(4, 4, d, stride=(2.0, 2.0)).reshape(4, 4, d)
    for i, j in ((0, 0), (1, 2), (3, 3)):
        dist = (full - coarse[i, j]).norm(dim=-1)  # (8, 8)
        nearest = set(dist.flatten().topk(4, largest=False).indices.tolist())
        block = {8 * r + c for r in (2 * i, 2 * i + 1) for c in (2 * j, 2 * j + 1)}
        assert nearest == block  # its 2x2 block of full-grid cells, nothing else
