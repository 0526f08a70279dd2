"""WordPiece tokenizer: special ids, padding/truncation, alignment, persistence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, normalizers

from vit_service.data import SPECIAL_TOKENS, TextTokenizer, train_tokenizer
from vit_service.data.tokenizer import renumber_pieces

WORDS = (
    "the movie film was great terrible acting plot story actor director scene music "
    "boring amazing good bad wonderful awful funny sad long short character ending"
).split()


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(300):
        words = rng.choice(WORDS, size=int(rng.integers(3, 15)))
        texts.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return texts


@pytest.fixture(scope="module")
def tok(corpus) -> TextTokenizer:
    return TextTokenizer.train(corpus, vocab_size=200, min_frequency=2)


def test_special_token_ids(tok, corpus) -> None:
    assert [tok.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert SPECIAL_TOKENS == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert len(SPECIAL_TOKENS) < tok.vocab_size <= 200
    raw = train_tokenizer(corpus, vocab_size=150)
    assert isinstance(raw, Tokenizer)
    assert raw.encode("great movie").ids[0] == 2  # raw tokenizer also starts with [CLS]


def test_padding_truncation_and_alignment(tok) -> None:
    texts = ["Great movie.", "The plot was boring and the acting was awful, sad ending!", ""]
    enc = tok.encode_batch(texts, max_len=8)
    assert enc.input_ids.dtype == torch.long and enc.attention_mask.dtype == torch.bool
    b, t = enc.input_ids.shape
    assert b == 3 and t == 8  # the long text hits max_len
    assert enc.truncated == [False, True, False]
    assert (enc.input_ids[:, 0] == tok.cls_id).all()
    assert (enc.input_ids[~enc.attention_mask] == tok.pad_id).all()
    assert enc.lengths.tolist() == [len(enc.tokens(i)) for i in range(3)]
    assert enc.tokens(2) == ["[CLS]"] and enc.lengths[2] == 1
    for i in range(3):
        pieces = enc.tokens(i)
        assert pieces[0] == "[CLS]"
        ids = enc.input_ids[i, : len(pieces)].tolist()
        assert ids == [tok.tokenizer.token_to_id(p) for p in pieces]
        assert enc.attention_mask[i, : len(pieces)].all()
        assert not enc.attention_mask[i, len(pieces) :].any()
    assert enc.tokens(0)[1:] == ["great", "movie", "."]  # lowercased, punctuation split

    short = tok.encode_batch(["Great movie.", "Bad."], max_len=64)
    assert short.input_ids.shape == (2, 4) and short.truncated == [False, False]


def test_normalisation_and_unknown(tok) -> None:
    a = tok.encode_batch(["CAFÉ Café café"], max_len=16).input_ids
    b = tok.encode_batch(["cafe cafe cafe"], max_len=16).input_ids
    assert torch.equal(a, b)
    enc = tok.encode_batch(["great ☃ movie"], max_len=16)
    assert enc.tokens(0)[2] == "[UNK]" and enc.input_ids[0, 2] == tok.unk_id
    assert tok.decode(tok.encode_batch(["Great movie!"], 16).input_ids[0]) == "great movie!"


def test_save_load_round_trip(tok, corpus, tmp_path) -> None:
    path = tmp_path / "sub" / "tokenizer.json"
    tok.save(path)
    loaded = TextTokenizer.load(path)
    again = TextTokenizer.from_str(tok.to_str())
    texts = corpus[:20] + ["Unseen wörds ☃ here."]
    ref = tok.encode_batch(texts, max_len=12)
    for other in (loaded, again):
        assert other.vocab_size == tok.vocab_size
        enc = other.encode_batch(texts, max_len=12)
        assert torch.equal(enc.input_ids, ref.input_ids)
        assert torch.equal(enc.attention_mask, ref.attention_mask)
        assert enc.truncated == ref.truncated


def test_encode_to_arrays_matches_encode_batch(tok, corpus) -> None:
    texts = corpus[:50] + [" ".join(corpus[:40])]  # one long text
    ids, lengths = tok.encode_to_arrays(texts, max_len=10, chunk_size=16)
    assert ids.shape == (51, 10) and ids.dtype == np.int32 and lengths.dtype == np.int64
    enc = tok.encode_batch(texts, max_len=10)
    for i in range(len(texts)):
        n = int(lengths[i])
        assert n == int(enc.lengths[i])
        assert ids[i, :n].tolist() == enc.input_ids[i, :n].tolist()
        assert (ids[i, n:] == tok.pad_id).all()
    assert lengths[-1] == 10


def test_long_texts_encode_exactly(tok, corpus) -> None:
    """The cut-long-texts shortcut gives the same pieces as encoding the whole text."""
    long_text = " ".join(corpus)  # thousands of characters
    unk_words = " ".join(["☃" * 40] * 60)  # few tokens per character: the cut is re-encoded
    texts = [long_text, unk_words, "short one."]
    for max_len in (2, 16, 300):
        enc = tok.encode_batch(texts, max_len=max_len)
        for i, text in enumerate(texts):
            full = tok.tokenizer.encode(text, add_special_tokens=False).ids
            n = int(enc.lengths[i])
            assert enc.input_ids[i, :n].tolist() == [tok.cls_id, *full[: max_len - 1]]
            assert enc.truncated[i] == (len(full) > max_len - 1)


def test_bad_arguments(tok) -> None:
    with pytest.raises(ValueError):
        tok.encode_batch(["a"], max_len=1)
    with pytest.raises(TypeError):
        tok.encode_batch("a text", max_len=8)
    with pytest.raises(TypeError):
        tok.encode_to_arrays("a text", max_len=8)
    with pytest.raises(ValueError, match="special"):
        TextTokenizer(Tokenizer.from_str(_without_specials(tok)))


def _without_specials(tok: TextTokenizer) -> str:
    import json

    data = json.loads(tok.to_str())
    data["added_tokens"] = []
    data["post_processor"] = None
    vocab = data["model"]["vocab"]
    for t in SPECIAL_TOKENS[2:]:
        vocab.pop(t)
    return json.dumps(data)


def test_head_tail_truncation_keeps_the_start_and_the_end(tok) -> None:
    from vit_service.data.tokenizer import head_tail_cut

    assert head_tail_cut(5, 8) == (5, 0)
    assert head_tail_cut(100, 8) == (2, 6)  # a quarter of the budget for the head
    words = [f"w{i}" for i in range(60)]
    text = " ".join(words)
    full = tok.encode_batch([text], 1000).pieces[0][1:]
    enc = tok.encode_batch([text], 17, truncation="head_tail")
    pieces = enc.pieces[0]
    assert pieces[0] == "[CLS]" and len(pieces) == 17 and enc.truncated == [True]
    assert pieces[1:5] == full[:4] and pieces[5:] == full[-12:]
    ids, lengths = tok.encode_to_arrays([text, "w1 w2"], 17, truncation="head_tail")
    assert ids[0].tolist() == enc.input_ids[0].tolist() and lengths.tolist()[1] < 17
    short = tok.encode_batch(["w1 w2"], 17, truncation="head_tail")
    assert short.truncated == [False] and short.pieces == tok.encode_batch(["w1 w2"], 17).pieces
    with pytest.raises(ValueError, match="truncation"):
        tok.encode_batch([text], 17, truncation="middle")  # type: ignore[arg-type]


def test_ids_are_the_sorted_pieces_and_segment_as_trained(corpus) -> None:
    """The trainer numbers equal-ranked pieces differently from run to run; the ids are
    renumbered (specials, then the pieces sorted) so the same piece set always gives the same
    ids, and the renumbering leaves every segmentation as the trainer's model made it."""
    from tokenizers import models, pre_tokenizers, trainers

    vocab = TextTokenizer.train(corpus, vocab_size=200, min_frequency=2).tokenizer.get_vocab()
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert pieces[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert pieces[len(SPECIAL_TOKENS):] == sorted(pieces[len(SPECIAL_TOKENS):])

    raw = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(corpus, trainer=trainers.WordPieceTrainer(
        vocab_size=200, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##", show_progress=False))
    renumbered = Tokenizer.from_str(raw.to_str())
    renumber_pieces(renumbered)
    assert set(renumbered.get_vocab()) == set(raw.get_vocab())
    assert renumbered.get_vocab() != raw.get_vocab()  # the trainer's own order is not sorted
    for t in [*corpus, "an unseen wordd, and the zzz film!"]:
        a, b = raw.encode(t), renumbered.encode(t)
        assert a.tokens == b.tokens
        assert b.ids == [renumbered.token_to_id(p) for p in a.tokens]
