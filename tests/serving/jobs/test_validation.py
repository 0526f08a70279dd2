"""Job requests name paths only inside the data and home folders, whatever shape the override
takes (a string, or a list of teacher bundles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.jobs.model import JobError
from serving.jobs.validation import resolve_paths


def test_each_teacher_bundle_of_an_ensemble_is_resolved_inside_the_roots(tmp_path: Path) -> None:
    data, home = tmp_path / "data", tmp_path / "home"
    for d in (data / "t1", home / "runs" / "t2"):
        d.mkdir(parents=True)
    out = resolve_paths({"data": {"pseudo_labels": ["t1", str(home / "runs" / "t2")]}},
                        [data, home])
    assert out["data"]["pseudo_labels"] == [str(data / "t1"), str(home / "runs" / "t2")]
    for fitted_by_the_run in ("teacher", "ngram"):
        assert resolve_paths({"data.pseudo_labels": fitted_by_the_run}, [data, home]) == {
            "data.pseudo_labels": fitted_by_the_run}


@pytest.mark.parametrize("value, needle", [
    (["t1", "/etc"], "data.pseudo_labels[1]"),
    (["../../x"], "outside the data and home"),
    (["t1", 3], "must be a path string"),
    ([], "must be a path string"),
    (["t1", "t\ud800"], "data.pseudo_labels[1]' is not valid Unicode"),  # a JSON escape
])
def test_a_bad_teacher_in_a_list_is_refused(tmp_path: Path, value: list, needle: str) -> None:
    with pytest.raises(JobError) as e:
        resolve_paths({"data.pseudo_labels": value}, [tmp_path])
    assert e.value.status == 422 and needle in str(e.value.detail)


def test_model_size_counts_the_ngram_head_and_refuses_a_bad_order() -> None:
    """The n-gram head's weights are buffers the parameter count misses: a job asking for a
    huge head is refused before it allocates, and an unknown head order before it runs."""
    from serving.jobs.validation import check_model_size, validate_recipe

    check_model_size("imdb-selftrain-cpu", {}, 60_000_000)
    huge = {"model.overrides.ngram_head_buckets": 2**30}
    with pytest.raises(JobError) as e:
        check_model_size("imdb-selftrain-cpu", huge, 60_000_000)
    assert e.value.status == 422 and "parameters" in str(e.value.detail)
    with pytest.raises(JobError) as e:
        validate_recipe("imdb-selftrain-cpu", {"model.overrides.ngram_head_order": 4})
    assert e.value.status == 422 and "ngram_head_order" in str(e.value.detail)
    # a JSON body's 1e999 is inf: no lr, rate or budget, in the schema's fields or the model's
    for key in ("optim.lr", "budget_minutes", "model.overrides.drop_rate"):
        for bad in (float("inf"), float("nan")):
            with pytest.raises(JobError) as e:
                validate_recipe("imdb-selftrain-cpu", {key: bad})
            assert e.value.status == 422 and "finite" in str(e.value.detail), (key, bad)
    # values no run can use, each refused before it is queued: seeds past numpy's range,
    # sizes that build no model, unbounded sizes that would exhaust memory or time
    for key, bad, says in (("seed", 10**30, "seed"), ("seed", -1, "seed"),
                           ("data.split_seed", -1, "split_seed"),
                           ("model.overrides.depth", -1, "depth must be > 0"),
                           ("model.overrides.embed_dim", 0, "embed_dim must be > 0"),
                           ("model.overrides.drop_path_rate", 1.5, "drop_path_rate"),
                           ("optim.lr", 1e308, "optim.lr"),
                           ("data.subset", 10**30, "data.subset")):
        with pytest.raises(JobError) as e:
            validate_recipe("imdb-selftrain-cpu", {key: bad})
        assert e.value.status == 422 and says in str(e.value.detail), (key, bad, e.value.detail)
    for key, bad in (("data.image_size", 10**9), ("augment.crop_padding", 10**9),
                     ("augment.randaugment_ops", 10**9)):
        with pytest.raises(JobError) as e:
            validate_recipe("cifar10-smoke", {key: bad})
        assert e.value.status == 422 and key in str(e.value.detail), (key, e.value.detail)
    with pytest.raises(JobError) as e:  # order 3 with one bucket: no room for pairs
        validate_recipe("imdb-selftrain-cpu", {"model.overrides.ngram_head_buckets": 1,
                                               "model.overrides.ngram_head_unit": "token",
                                               "model.overrides.ngram_head_order": 3})
    assert e.value.status == 422 and "ngram_head_buckets" in str(e.value.detail)


def test_a_string_that_is_no_text_is_refused_wherever_it_is() -> None:
    """A JSON "\\ud800" escape in any override (a description, a key, a nested list item)
    is a 422 naming where, before anything is resolved, validated or stored."""
    from serving.jobs.validation import check_text

    check_text("overrides", {"description": "café ☕", "data": {"path": ["a", "b"]}})
    for value, where in (({"description": "x\ud800"}, "override 'description'"),
                         ({"augment.\udc00": 1}, "overrides key"),
                         ({"data": {"pseudo_labels": ["t1", "\udfff"]}},
                          "override 'data'.pseudo_labels[1]")):
        with pytest.raises(JobError) as e:
            check_text("overrides", value)
        assert e.value.status == 422 and where in e.value.detail, e.value.detail


@pytest.mark.parametrize("overrides", [
    {}, {"stem": "conv", "stem_width": 24}, {"stem": "conv", "stem_width": 24, "stem_depth": 2},
    {"stem": "conv", "stem_width": 64, "stem_depth": 3},
    {"stem": "conv", "stem_width": 32, "stem_depth": 2, "stem_full_depth": 1},
    {"stem": "conv", "stem_width": 16, "stem_depth": 1, "stem_full_depth": 4},
])
def test_the_size_estimate_bounds_the_built_conv_stem_from_above(overrides: dict) -> None:
    """A job's size is refused on the estimate, before anything is built: a deeper stem must not
    slip under the cap by being counted as a one-conv-per-resolution stem."""
    from serving.jobs.validation import estimate_parameters
    from vit_service.models import count_parameters, create_model, get_config

    cfg = get_config("vit_nano_patch4_32", **overrides)
    built = count_parameters(create_model("vit_nano_patch4_32", **overrides))
    assert built <= estimate_parameters(cfg) <= 1.25 * built


def test_a_conv_stem_with_no_convs_is_refused_before_it_is_queued() -> None:
    from serving.jobs.validation import validate_recipe

    for key in ("model.overrides.stem_depth", "model.overrides.stem_width",
                "model.overrides.stem_full_depth"):
        with pytest.raises(JobError) as e:
            validate_recipe("cifar10-vit-convstem-cpu", {key: 0})
        assert e.value.status == 422 and f"{key.rsplit('.', 1)[1]} must be > 0" in str(
            e.value.detail), e.value.detail
