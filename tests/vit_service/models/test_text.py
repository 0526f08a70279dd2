import pytest
import torch

from vit_service.models import create_model
from vit_service.models.text import pair_buckets


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
@pytest.mark.parametrize("fused", [True, False])
def test_appending_padding_does_not_change_logits(pool: str, pos: str, fused: bool) -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool=pool, pos_encoding=pos).eval()
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
    ids = torch.randint(5, 1000, (3, 20))
    ids[:, 0] = 2  # [CLS]
    padded = torch.cat([ids, torch.zeros(3, 25, dtype=torch.long)], dim=1)  # 25 [PAD]s
    with torch.no_grad():
        torch.testing.assert_close(m(padded), m(ids), atol=1e-5, rtol=0)


def test_batch_with_different_lengths_equals_one_by_one() -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean").eval()
    a = torch.randint(5, 1000, (1, 30))
    b = torch.randint(5, 1000, (1, 11))
    batch = torch.zeros(2, 30, dtype=torch.long)
    batch[0] = a
    batch[1, :11] = b
    with torch.no_grad():
        out = m(batch)
        torch.testing.assert_close(out[0], m(a)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], m(b)[0], atol=1e-5, rtol=0)


def test_padding_embedding_is_zero_and_padded_keys_get_no_attention() -> None:
    m = create_model("text_test").eval()
    assert torch.all(m.tok_embed.weight[0] == 0)
    ids = torch.tensor([[2, 10, 11, 12, 0, 0]])
    _, attn = m.forward_with_attention(ids)
    assert attn.shape == (2, 1, 2, 6, 6)
    assert torch.all(attn[..., 4:] == 0)


def test_too_long_input_is_rejected() -> None:
    m = create_model("text_test")
    with pytest.raises(ValueError, match="max_len"):
        m(torch.ones(1, 65, dtype=torch.long))


def _with_random_bigrams(**kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean", bigram_buckets=97, **kw).eval()
    with torch.no_grad():  # zero-initialised: give the pairs weights that matter
        m.bigram_embed.weight.normal_(0.0, 0.5)
    return m


def test_bigram_buckets_are_per_pair_and_in_range() -> None:
    m = _with_random_bigrams()
    ids = torch.tensor([[2, 10, 11, 10, 11, 12, 11]])
    b = m.bigram_ids(ids)
    assert b.shape == ids.shape and int(b.min()) >= 0 and int(b.max()) < 97
    assert b[0, 2] == b[0, 4]  # the pair (10, 11) twice, same bucket
    assert b[0, 2] != b[0, 6]  # (10, 11) vs (12, 11): another bucket for this hash
    assert b[0, 0] == m.bigram_ids(torch.tensor([[2]]))[0, 0]  # ([PAD], [CLS]) at the start


@pytest.mark.parametrize("bigram_dim", [0, 8])  # 8: a narrow table projected to D = 32
def test_zero_bigram_embedding_is_the_unigram_model(bigram_dim: int) -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean", bigram_buckets=97, bigram_dim=bigram_dim).eval()
    assert (m.bigram_proj is None) == (bigram_dim == 0)
    ids = torch.randint(5, 1000, (2, 20))
    with torch.no_grad():
        with_zero = m(ids)
        m.bigram_embed = None
        torch.testing.assert_close(with_zero, m(ids), atol=0, rtol=0)


def test_bigrams_see_word_order_and_keep_padding_invariance() -> None:
    m = _with_random_bigrams(pos_encoding="learned")
    with torch.no_grad():
        m.pos_embed.zero_()  # no positions: without bigrams, mean pooling ignores the order
        ids = torch.tensor([[2, 10, 11, 12, 13]])
        swapped = torch.tensor([[2, 11, 10, 13, 12]])
        assert not torch.allclose(m(ids), m(swapped))
        m_uni = _with_random_bigrams(pos_encoding="learned")
        m_uni.pos_embed.zero_()
        m_uni.bigram_embed = None
        torch.testing.assert_close(m_uni(ids), m_uni(torch.tensor([[2, 11, 10, 13, 12]])),
                                   atol=1e-5, rtol=0)
        padded = torch.cat([ids, torch.zeros(1, 7, dtype=torch.long)], dim=1)
        torch.testing.assert_close(m(padded), m(ids), atol=1e-5, rtol=0)


def _with_ngram_head(buckets: int = 97, order: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean", ngram_head_buckets=buckets,
                     ngram_head_order=order).eval()
    with torch.no_grad():  # zero until a run fits it: give every feature a weight
        m.ngram_head.weight.normal_(0.0, 1.0)
        m.ngram_head.bias.normal_(0.0, 1.0)
    return m


def test_ngram_head_adds_the_weights_of_each_distinct_token_and_pair_once() -> None:
    m = _with_ngram_head()
    head, V = m.ngram_head, m.config.vocab_size
    ids = torch.tensor([[2, 10, 11, 10, 11, 12, 0, 0]])  # (10, 11) twice, then padding
    mask = ids != 0
    feats = {2, 10, 11, 12} | {V + int(pair_buckets(torch.tensor(a), torch.tensor(b), 97))
                               for a, b in [(2, 10), (10, 11), (11, 10), (11, 12)]}
    expected = head.weight[sorted(feats)].sum(0) + head.bias
    with torch.no_grad():
        torch.testing.assert_close(head(ids, mask)[0], expected)
        got = head.features(ids, mask)[0]
        assert sorted(got[got >= 0].tolist()) == sorted(feats)
        # the served logits are the mean of the Transformer's and the head's
        plain = create_model("text_test", pool="mean")
        plain.load_state_dict({k: v for k, v in m.state_dict().items()
                               if not k.startswith("ngram_head.")})
        torch.testing.assert_close(m(ids), (plain.eval()(ids) + head(ids, mask)) / 2)


def test_ngram_head_keeps_padding_invariance_and_drops_masked_tokens() -> None:
    m = _with_ngram_head()
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        padded = torch.cat([ids, torch.zeros(1, 7, dtype=torch.long)], dim=1)
        torch.testing.assert_close(m(padded), m(ids), atol=1e-5, rtol=0)
        # a token masked out (as faithfulness curves delete them) leaves the head's sum too,
        # with its two pairs; the pair across the gap is not a pair
        mask = torch.tensor([[True, True, False, True, True]])
        short = torch.tensor([[2, 10, 12, 13]])
        h = m.ngram_head
        gap = m.config.vocab_size + int(pair_buckets(torch.tensor(10), torch.tensor(12), 97))
        expected = h(short, torch.ones_like(short, dtype=torch.bool)) - h.weight[gap]
        torch.testing.assert_close(h(ids, mask), expected)


def test_a_zero_ngram_head_pools_with_the_transformer_and_a_new_classifier_resets_it() -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean", ngram_head_buckets=97).eval()
    ids = torch.randint(5, 1000, (2, 20))
    with torch.no_grad():
        before = m(ids)  # an unfitted head's logits are all 0: the mean halves the Transformer's
        m.ngram_head = None
        torch.testing.assert_close(before, m(ids) / 2, atol=0, rtol=0)
    m.reset_classifier(5)
    assert m.ngram_head.weight.shape == (1000 + 97, 5) and not m.ngram_head.weight.any()
    assert not any(p is m.ngram_head.weight for p in m.parameters())  # never trained by SGD


def test_the_ngram_head_counts_in_eval_mode_only() -> None:
    m = _with_ngram_head()
    m.config.drop_rate = 0.0
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    ids = torch.randint(5, 1000, (2, 20))
    with torch.no_grad():
        served = m(ids)
        trained = m.train()(ids)
        torch.testing.assert_close(served, (trained + m.ngram_head(ids, ids != 0)) / 2)


def _triple_feature(V: int, a: int, b: int, c: int, buckets: int) -> int:
    t = torch.tensor
    first_two = pair_buckets(t(a), t(b), 2**31)
    return V + buckets // 2 + int(pair_buckets(first_two, t(c), buckets - buckets // 2))


def test_an_order_3_head_adds_each_distinct_triple_once_in_its_half_of_the_buckets() -> None:
    m = _with_ngram_head(buckets=101, order=3)
    head, V = m.ngram_head, m.config.vocab_size
    ids = torch.tensor([[2, 10, 11, 12, 10, 11, 12, 13, 0]])  # (10, 11, 12) twice, padding
    mask = ids != 0
    t = torch.tensor
    pairs = {V + int(pair_buckets(t(a), t(b), 50))
             for a, b in [(2, 10), (10, 11), (11, 12), (12, 10), (12, 13)]}
    triples = {_triple_feature(V, a, b, c, 101) for a, b, c in
               [(2, 10, 11), (10, 11, 12), (11, 12, 10), (12, 10, 11), (11, 12, 13)]}
    assert all(V <= f < V + 50 for f in pairs) and all(V + 50 <= f < V + 101 for f in triples)
    feats = {2, 10, 11, 12, 13} | pairs | triples
    with torch.no_grad():
        got = head.features(ids, mask)[0]
        assert sorted(got[got >= 0].tolist()) == sorted(feats)
        torch.testing.assert_close(head(ids, mask)[0], head.weight[sorted(feats)].sum(0)
                                   + head.bias)
        # a masked-out token breaks every pair and triple across it
        gap = torch.tensor([[True, True, True, False, True, True, True, True, False]])
        f = head.features(ids, gap)[0]
        assert _triple_feature(V, 10, 11, 12, 101) in f.tolist()  # the second occurrence
        assert _triple_feature(V, 11, 12, 10, 101) not in f.tolist()
        # a text that encodes to no piece is [CLS] alone: one token, no pair, no triple
        cls_only = torch.tensor([[2]])
        torch.testing.assert_close(head(cls_only, cls_only != 0)[0], head.weight[2] + head.bias)
        torch.testing.assert_close(head.contributions(cls_only, cls_only != 0)[0, 0],
                                   head.weight[2])
    with pytest.raises(ValueError, match="ngram_head_order"):
        create_model("text_test", ngram_head_buckets=97, ngram_head_order=4)
    # order 3 gives half the buckets to pairs: one bucket would leave them none to hash into
    with pytest.raises(ValueError, match="ngram_head_buckets"):
        create_model("text_test", ngram_head_buckets=1, ngram_head_order=3)
    m = create_model("text_test", ngram_head_buckets=2, ngram_head_order=3).eval()
    assert m(torch.tensor([[2, 5, 6, 7]])).isfinite().all()


@pytest.mark.parametrize("order", [2, 3])
def test_ngram_contributions_split_each_ngram_over_its_tokens_and_sum_to_the_head(order: int
                                                                                 ) -> None:
    m = _with_ngram_head(buckets=101, order=order)
    head, V = m.ngram_head, m.config.vocab_size
    ids = torch.tensor([[2, 10, 11, 10, 11, 12, 0, 0], [2, 14, 15, 16, 17, 18, 19, 20]])
    mask = ids != 0
    mask[1, 4] = False  # masked out (as faithfulness deletes): no share, its n-grams gone
    with torch.no_grad():
        c = head.contributions(ids, mask)  # (B, T, K)
        torch.testing.assert_close(c.sum(1), head(ids, mask) - head.bias)
        assert not c[0, 6:].any() and not c[1, 4].any()  # padding, the masked token
        # the second (10, 11) repeats: 11 at position 4 gets only the pair (11, 12)'s share
        # (and, with triples, a third of (10, 11, 12) and (11, 12, ...)); the first 11 got
        # its unigram weight and half of each pair around it
        w = head.weight
        p = lambda a, b: V + int(pair_buckets(torch.tensor(a), torch.tensor(b),  # noqa: E731
                                              head.pair_buckets))
        if order == 2:
            torch.testing.assert_close(c[0, 4], w[p(11, 12)] / 2)
            torch.testing.assert_close(c[0, 2], w[11] + (w[p(10, 11)] + w[p(11, 10)]) / 2)
        torch.testing.assert_close(m.ngram_contributions(ids, mask), c / 2)
    assert create_model("text_test").ngram_contributions(ids) is None


# --- student_len: the Transformer reads a head+tail crop, the n-gram head everything -----------

def test_the_transformer_reads_the_crop_head_tail_truncation_would_have_cut(crop_pair) -> None:
    tok, m, plain = crop_pair
    texts = [" ".join(f"w{i}" for i in range(n)) for n in (55, 30, 9, 3)]
    long = tok.encode_batch(texts, 40, truncation="head_tail")
    short = tok.encode_batch(texts, 10, truncation="head_tail")
    ids, mask, pos = m.student_view(long.input_ids, long.attention_mask)
    assert pos is not None
    for i in range(len(texts)):
        assert ids[i][mask[i]].tolist() == short.input_ids[i][short.attention_mask[i]].tolist()
    with torch.no_grad():  # the same weights without the crop, on the short encoding
        torch.testing.assert_close(m(long.input_ids, long.attention_mask),
                                   plain(short.input_ids, short.attention_mask))
        logits, attn = m.forward_with_attention(long.input_ids, long.attention_mask)
        _, want = plain.forward_with_attention(short.input_ids, short.attention_mask)
    assert attn.shape[-1] == 10  # the crop's weights, never the input's 40 x 40
    read, at = m.read_tokens(long.input_ids, long.attention_mask)
    assert torch.equal(at, pos) and read.shape == (len(texts), 10)
    for i in range(len(texts)):
        n = int(short.attention_mask[i].sum())
        assert read[i].sum() == n
        torch.testing.assert_close(attn[:, i, :, :n, :n], want[:, i, :, :n, :n])
    # as wide as a trace made on long inputs reads a short one: the same tokens, then padding
    read, at = m.read_tokens(short.input_ids, short.attention_mask, width=12)
    assert read.shape == (len(texts), 12) and torch.equal(read[:, :10], short.attention_mask)
    assert not read[:, 10:].any()
    assert m.read_tokens(short.input_ids, short.attention_mask, width=10)[1] is None


def test_a_masked_token_moves_no_other_in_the_crop_and_the_transformer_refuses_more(
        crop_pair) -> None:
    tok, m, _ = crop_pair
    enc = tok.encode_batch([" ".join(f"w{i}" for i in range(50))], 40, truncation="head_tail")
    _, _, pos = m.student_view(enc.input_ids, enc.attention_mask)
    removed = enc.attention_mask.clone()
    removed[0, -1] = False  # faithfulness deletes the last token: the crop keeps its place
    _, mask, pos2 = m.student_view(enc.input_ids, removed)
    assert torch.equal(pos, pos2) and not mask[0, -1] and mask[0, :-1].all()
    with pytest.raises(ValueError, match="student_len"):
        m.forward_features(enc.input_ids)  # 40 tokens > the Transformer's 10: crop first
    with pytest.raises(ValueError, match="student_len"):
        create_model("text_test", max_len=16, student_len=1)


def test_the_position_table_is_the_crops_and_never_longer_than_the_input() -> None:
    assert create_model("text_test", max_len=40, student_len=10).pos_embed.shape[1] == 10
    assert create_model("text_test", max_len=40, student_len=400).pos_embed.shape[1] == 40
    assert create_model("text_test", max_len=40).pos_embed.shape[1] == 40
