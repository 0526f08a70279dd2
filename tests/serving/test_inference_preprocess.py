"""What the served model does by default is what training evaluated: head+tail truncation of
texts and a mean-pooling model's attention maps read the mean token row."""

from datetime import UTC, datetime

import torch

from serving.inference import TextJob, run_jobs
from serving.model_store import LoadedModel, Resolved
from vit_service.bundle import BundleMeta, ModelBundle
from vit_service.data.tokenizer import TextTokenizer
from vit_service.models import config_to_dict, create_model
from vit_service.pipeline import ExplainSpec

WORDS = [f"w{i}" for i in range(40)]


def _loaded(truncation: str, pool: str = "mean") -> LoadedModel:
    tok = TextTokenizer.train([" ".join(WORDS)] * 20, vocab_size=120)
    torch.manual_seed(0)
    net = create_model("text_test", vocab_size=tok.vocab_size, max_len=12, pool=pool,
                       pad_id=tok.pad_id).eval()
    meta = BundleMeta(task="text", model_config=config_to_dict(net.config),
                      class_names=["negative", "positive"],
                      preprocess={"max_len": 12, "truncation": truncation})
    return LoadedModel("m", "test", ModelBundle(net, meta, tok), Resolved("x"), None,
                       datetime.now(UTC), 0.0)


def test_served_text_is_truncated_as_the_model_was_trained() -> None:
    text = " ".join(WORDS)
    for truncation, expected in (("head", WORDS[:11]), ("head_tail", WORDS[:2] + WORDS[-9:])):
        model = _loaded(truncation)
        out = run_jobs(model, [TextJob([text], 2, ExplainSpec())])[0]
        res = out.results[0]
        assert res.tokens == expected and res.truncated is True
        assert model.query == "mean"


def test_mean_pooling_models_read_the_mean_token_row() -> None:
    from vit_service.attention_maps import attention_rollout

    model = _loaded("head", pool="mean")
    tok, net = model.bundle.tokenizer, model.bundle.model
    enc = tok.encode_batch(["w1 w2 w3 w4"], 12)
    with torch.no_grad():
        _, attn = net.forward_with_attention(enc.input_ids, enc.attention_mask)
    want = attention_rollout(attn, attention_mask=enc.attention_mask, query="mean")[0]
    out = run_jobs(model, [TextJob(["w1 w2 w3 w4"], 2, ExplainSpec())])[0]
    got = torch.tensor(out.results[0].attention.rollout)
    assert torch.allclose(got, want, atol=1e-5)
    assert _loaded("head", pool="cls").query == "cls"


def test_one_undecodable_input_fails_its_own_request_only() -> None:
    """A batch whose decoding fails (a lone surrogate, which the tokenizer cannot take; the API
    refuses it with a 422 before it gets here) is run again job by job: the other requests
    batched with it get their answers, and the model is not marked unable to give relevance
    for a fault of the input's."""
    model = _loaded("head_tail")
    spec = ExplainSpec(relevance=True)
    good = ["w1 w2 w3", "w4 w5 w6 w7"]
    jobs = [TextJob([good[0]], 2, spec), TextJob(["w1 \ud800 w2"], 2, spec),
            TextJob([good[1]], 2, spec)]
    out = run_jobs(model, jobs)
    assert isinstance(out[1], Exception)
    assert model.relevance_unavailable is None
    for i, text in ((0, good[0]), (2, good[1])):
        alone = run_jobs(model, [TextJob([text], 2, spec)])[0].results[0]
        got = out[i].results[0]
        assert got.tokens == alone.tokens and got.predictions == alone.predictions
        assert torch.allclose(torch.tensor(got.attention.relevance),
                              torch.tensor(alone.attention.relevance), atol=1e-6)


def test_a_relevance_pass_that_fails_in_the_model_is_not_run_once_per_job(monkeypatch) -> None:
    """When the model's relevance pass itself fails, the first job run alone marks the version
    and the rest of the batch gets the same 422 without another pass; the failed group's
    stage timings are not reported."""
    import serving.inference as inference

    calls: list[int] = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no backward in this precision")

    monkeypatch.setattr(inference, "explain_batch", broken)
    model = _loaded("head_tail")
    spec = ExplainSpec(relevance=True)
    seen: list[str] = []
    out = run_jobs(model, [TextJob([f"w{i} w{i + 1}"], 2, spec) for i in range(4)],
                   lambda stage, s: seen.append(stage))
    assert len(calls) == 2  # the group, then the first job alone
    assert model.relevance_unavailable and "RuntimeError" in model.relevance_unavailable
    assert all(getattr(o, "status_code", None) == 422 for o in out), out
    assert seen == []  # nothing succeeded: no stage was timed


def test_a_model_whose_transformer_reads_a_crop_explains_the_whole_text() -> None:
    """``student_len``: the tokens are the whole (max_len) text; the attention maps and the
    relevance cover the Transformer's head+tail crop (0 elsewhere, each summing to 1); the word
    n-gram head's shares cover every word; the answer is the model's own."""
    tok = TextTokenizer.train([" ".join(WORDS)] * 20, vocab_size=120)
    torch.manual_seed(0)
    net = create_model("text_test", vocab_size=tok.vocab_size, max_len=24, pool="mean",
                       pad_id=tok.pad_id, student_len=9, ngram_head_buckets=101,
                       ngram_head_unit="word").eval()
    net.ngram_head.read_pieces(tok.pieces())
    with torch.no_grad():
        net.ngram_head.weight.normal_()
    meta = BundleMeta(task="text", model_config=config_to_dict(net.config),
                      class_names=["negative", "positive"],
                      preprocess={"max_len": 24, "truncation": "head_tail"})
    model = LoadedModel("m", "test", ModelBundle(net, meta, tok), Resolved("x"), None,
                        datetime.now(UTC), 0.0)
    text = " ".join(WORDS[:30])
    spec = ExplainSpec(heads=True, relevance=True, faithfulness=True)
    res = run_jobs(model, [TextJob([text], 2, spec)])[0].results[0]
    assert res.tokens == WORDS[:5] + WORDS[12:30]  # 23 pieces: 5 head + 18 tail
    crop = list(range(2)) + list(range(23 - 6, 23))  # of the 8 pieces: 2 head + 6 tail
    rollout, relevance = torch.tensor(res.attention.rollout), torch.tensor(
        res.attention.relevance)
    outside = torch.ones(23, dtype=torch.bool)
    outside[crop] = False
    for m in (rollout, relevance, torch.tensor(res.attention.layers), torch.tensor(
            res.attention.heads)):
        assert m.shape[-1] == 23 and not m[..., outside].any()
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    ngram = torch.tensor(res.attention.ngram)
    assert ngram.shape == (23,) and ngram[outside].abs().sum() > 0
    enc = tok.encode_batch([text], 24, truncation="head_tail")
    with torch.no_grad():
        want = net(enc.input_ids, enc.attention_mask).softmax(-1)[0]
    assert abs(res.predictions[0].probability - float(want.max())) < 1e-5
    assert res.faithfulness is not None
