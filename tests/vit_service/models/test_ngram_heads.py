"""``vit_service.models.ngram_heads``: the word n-gram head forms the words the NB-LR teacher
reads from token ids alone, adds each distinct word and word pair once, and explains exactly."""

import re

import pytest
import torch

from vit_service.data.tokenizer import TextTokenizer
from vit_service.models import create_model
from vit_service.models.ngram_heads import (
    BI_MUL,
    BI_MUL2,
    P31,
    PIECE_CONT,
    PIECE_SKIP,
    PIECE_START,
    UNI_MUL,
    WORD_BASE,
    WordNgramHead,
    piece_kinds,
)

PIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "!", "?", "##!",
          "good", "bad", "un", "##believ", "##able", "film", "##s", "<", "br", "##.", "9"]
V = len(PIECES)
ID = {p: i for i, p in enumerate(PIECES)}


def _head(buckets: int = 1 << 20) -> WordNgramHead:
    torch.manual_seed(0)
    head = WordNgramHead(V, buckets, 2)
    head.read_pieces(PIECES)
    with torch.no_grad():
        head.weight.normal_()
        head.bias.normal_()
    return head


def _key(word: list[int]) -> int:  # the polynomial of a word's piece ids, in Python ints
    return sum((i + 1) * pow(WORD_BASE, j, P31) for j, i in enumerate(word)) % P31


def _uni(k: int, buckets: int) -> int:
    return (k * UNI_MUL + 1) % P31 % buckets


def _bi(a: int, b: int, buckets: int) -> int:
    return ((a * BI_MUL % P31 + b + 2) % P31) * BI_MUL2 % P31 % buckets


def _ids(*pieces: str) -> torch.Tensor:
    return torch.tensor([[ID[p] for p in pieces]])


def test_piece_kinds_follow_the_teachers_token_pattern() -> None:
    kinds = piece_kinds(PIECES).tolist()
    assert [kinds[ID[p]] for p in ("[CLS]", "[PAD]", ",", ".", "<", "##.")] == [PIECE_SKIP] * 6
    assert [kinds[ID[p]] for p in ("!", "?", "good", "un", "br", "9")] == [PIECE_START] * 6
    assert [kinds[ID[p]] for p in ("##believ", "##s", "##!")] == [PIECE_CONT] * 3
    with pytest.raises(ValueError, match="pieces for a vocabulary"):
        WordNgramHead(V + 1, 8, 2).read_pieces(PIECES)


def test_words_are_pieces_joined_at_hashes_and_each_distinct_feature_counts_once() -> None:
    head, B = _head(), 1 << 20
    # "[CLS] un ##believ ##able film ##s , good ! good ! <br /> bad"; "," and "<" are skipped
    # and do not break a pair; "good !" repeats, so its words and pair count once
    ids = _ids("[CLS]", "un", "##believ", "##able", "film", "##s", ",", "good", "!", "good",
               "!", "<", "br", "bad")
    words = [[ID["un"], ID["##believ"], ID["##able"]], [ID["film"], ID["##s"]], [ID["good"]],
             [ID["!"]], [ID["good"]], [ID["!"]], [ID["br"]], [ID["bad"]]]
    keys = [_key(w) for w in words]
    want = {_uni(k, B) for k in keys} | {_bi(a, b, B) for a, b in zip(keys[:-1], keys[1:],
                                                                       strict=True)}
    mask = torch.ones_like(ids, dtype=torch.bool)
    got_keys, word_of = head.words(ids, mask)
    assert got_keys[0, : len(keys)].tolist() == keys and (got_keys[0, len(keys):] == -1).all()
    assert word_of[0].tolist() == [-1, 0, 0, 0, 1, 1, -1, 2, 3, 4, 5, -1, 6, 7]
    f = head.features(ids, mask)[0]
    assert sorted(f[f >= 0].tolist()) == sorted(want) and len(want) == 6 + 6  # 6 words, 6 pairs
    with torch.no_grad():
        torch.testing.assert_close(head(ids, mask)[0], head.weight[sorted(want)].sum(0)
                                   + head.bias)


def test_padding_does_not_count_and_a_masked_piece_ends_its_word() -> None:
    head = _head()
    ids = _ids("[CLS]", "un", "##believ", "##able", "film", "[PAD]", "[PAD]")
    mask = ids != 0
    with torch.no_grad():
        torch.testing.assert_close(head(ids, mask), head(ids[:, :5], mask[:, :5]))
        mask2 = mask.clone()
        mask2[0, 2] = False  # "##believ" removed: "un" and "##able" are two words now
        keys, word_of = head.words(ids, mask2)
        assert word_of[0].tolist() == [-1, 0, -1, 1, 2, -1, -1]
        assert keys[0, :3].tolist() == [_key([ID["un"]]), _key([ID["##able"]]),
                                        _key([ID["film"]])]


def test_contributions_split_each_word_over_its_pieces_and_sum_to_the_head() -> None:
    head, B = _head(), 1 << 20
    ids = torch.cat([_ids("[CLS]", "good", "film", "##s", "!", "good", "film", "##s"),
                     _ids("[CLS]", "bad", ",", "un", "##believ", "##able", "[PAD]", "[PAD]")])
    mask = ids != 0
    mask[1, 4] = False
    with torch.no_grad():
        c = head.contributions(ids, mask)  # (B, T, K)
        torch.testing.assert_close(c.sum(1), head(ids, mask) - head.bias)
        assert not c[0, 0].any() and not c[1, 2].any() and not c[1, 4].any() and \
            not c[1, 6:].any()  # [CLS], a skipped comma, a masked piece, padding
        w = head.weight
        k_good, k_films, k_bang = (_key([ID["good"]]), _key([ID["film"], ID["##s"]]),
                                   _key([ID["!"]]))
        # "films" (2 pieces): its unigram, half of (good, films) and of (films, !), per piece
        share = w[_uni(k_films, B)] + (w[_bi(k_good, k_films, B)] + w[_bi(k_films, k_bang, B)]) / 2
        torch.testing.assert_close(c[0, 2], share / 2)
        torch.testing.assert_close(c[0, 3], share / 2)
        # the repeated "good films": only the new pair (!, good) is left to share
        torch.testing.assert_close(c[0, 5], w[_bi(k_bang, k_good, B)] / 2)
        assert not c[0, 6:].any()


def test_a_real_vocabulary_makes_the_teachers_words() -> None:
    """With a trained WordPiece vocabulary, the head's distinct words are the texts' distinct
    words by the NB-LR teacher's pattern (texts without apostrophes, where the two agree)."""
    texts = ["an unbelievably good film, truly good!", "a bad bad movie? no: awful.",
             "the films were wonderful and the acting superb"] * 20
    tok = TextTokenizer.train(texts, vocab_size=120)
    head = WordNgramHead(tok.vocab_size, 1 << 24, 2)
    head.read_pieces(tok.pieces())
    enc = tok.encode_batch(texts[:3], max_len=64)
    for i, text in enumerate(texts[:3]):
        keys, _ = head.words(enc.input_ids[i : i + 1], enc.attention_mask[i : i + 1])
        n_words = len(re.findall(r"(?u)\b\w[\w']*\b|[!?]", text.lower()))
        assert int((keys >= 0).sum()) == n_words, text
        distinct = {w for w in re.findall(r"(?u)\b\w[\w']*\b|[!?]", text.lower())}
        assert len(set(keys[keys >= 0].tolist())) == len(distinct)


def test_a_text_model_builds_the_head_it_is_asked_for() -> None:
    m = create_model("text_test", ngram_head_buckets=64, ngram_head_unit="word")
    assert isinstance(m.ngram_head, WordNgramHead) and m.ngram_head.num_features == 64
    assert "ngram_head.piece_kind" in m.state_dict()  # saved with the model
    with pytest.raises(ValueError, match="ngram_head_order must be 2"):
        create_model("text_test", ngram_head_buckets=64, ngram_head_unit="word",
                     ngram_head_order=3)
    with pytest.raises(ValueError, match="ngram_head_unit"):
        create_model("text_test", ngram_head_buckets=64, ngram_head_unit="char")
