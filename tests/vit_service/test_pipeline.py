"""``vit_service.pipeline``: maps of a model whose Transformer reads a crop are computed over
the crop and placed at the input's positions."""

from __future__ import annotations

import torch

from vit_service.pipeline import ExplainSpec, ReadTokens, TextInputs, explain_batch

WORDS = [f"w{i}" for i in range(60)]


def test_placing_puts_each_value_at_its_tokens_position_and_nothing_elsewhere() -> None:
    # two rows of an input of 8 ([CLS] + 7); the crop read 4: [CLS] and three tokens
    positions = torch.tensor([[0, 1, 6, 7], [0, 1, 2, 2]])  # the second: 3 tokens, 1 padding
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    maps = torch.tensor([[[0.2, 0.3, 0.5]], [[0.6, 0.4, 9.0]]])  # (B, 1, W - 1)
    placed = ReadTokens(mask, positions, 8).place(maps)  # (B, 1, 7)
    assert placed.shape == (2, 1, 7)
    torch.testing.assert_close(placed[0, 0], torch.tensor([0.2, 0, 0, 0, 0, 0.3, 0.5]))
    torch.testing.assert_close(placed[1, 0], torch.tensor([0.6, 0.4, 0, 0, 0, 0, 0]))
    assert ReadTokens(mask, None, 8).place(maps) is maps  # no crop: as computed


def test_a_crop_models_maps_and_relevance_are_those_of_its_crop_placed_in_the_input(
        crop_pair) -> None:
    """The same weights with ``student_len`` on the whole text and without it on the text
    head+tail-truncated to the crop: every map (rollout, layers, heads, relevance) is the
    second one's, at the crop's positions in the whole text, 0 elsewhere."""
    tok, m, plain = crop_pair
    texts = [" ".join(WORDS[:n]) for n in (55, 30, 9, 3)]
    long = tok.encode_batch(texts, 40, truncation="head_tail")
    short = tok.encode_batch(texts, 10, truncation="head_tail")
    spec = ExplainSpec(heads=True, relevance=True)
    got = explain_batch(m, TextInputs(long.input_ids, long.attention_mask), spec)
    want = explain_batch(plain, TextInputs(short.input_ids, short.attention_mask), spec)
    torch.testing.assert_close(got.probs, want.probs)
    _, pos = m.read_tokens(long.input_ids, long.attention_mask)
    assert pos is not None
    T = long.input_ids.shape[1]
    assert got.maps is not None and want.maps is not None and got.relevance is not None
    for g, w in ((got.maps.rollout, want.maps.rollout), (got.maps.layers, want.maps.layers),
                 (got.maps.heads, want.maps.heads), (got.relevance, want.relevance)):
        assert g is not None and w is not None and g.shape[-1] == T - 1
        for i in range(len(texts)):
            n = int(short.attention_mask[i].sum())
            at = pos[i, 1:n] - 1  # the crop's tokens after [CLS], in the input
            torch.testing.assert_close(g[i][..., at], w[i][..., :n - 1])
            outside = torch.ones(T - 1, dtype=torch.bool)
            outside[at] = False
            assert not g[i][..., outside].any()
