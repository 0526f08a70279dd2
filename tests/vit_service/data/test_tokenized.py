"""vit_service/data/tokenized.py: the padding mask and the length-sorted batches every text
evaluation loop reads (pseudo-labelling, `vit-service evaluate`)."""

from __future__ import annotations

import numpy as np
import torch

from vit_service.data.tokenized import length_sorted_batches, padding_mask


def test_padding_mask_marks_each_rows_real_tokens() -> None:
    mask = padding_mask(torch.tensor([3, 1, 0]), 4)
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False],
                             [False] * 4]


def test_batches_cover_every_row_once_shortest_first_cut_to_their_longest() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=11).astype(np.int64)
    ids = np.zeros((11, 8), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = i + 1  # each row's real tokens carry its number
    seen, last_max = [], 0
    for rows, x, mask in length_sorted_batches(ids, lengths, batch_size=4):
        assert x.dtype == torch.int64 and x.shape == mask.shape
        assert x.shape[1] == lengths[rows].max() >= last_max
        last_max = x.shape[1]
        assert mask.sum(1).tolist() == lengths[rows].tolist()
        assert (x[mask] == torch.from_numpy(np.repeat(rows + 1, lengths[rows]))).all()
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(11))
    assert list(lengths[seen]) == sorted(lengths)
