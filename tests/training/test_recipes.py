import re
from pathlib import Path

import pytest

from training.recipe_schema import RESERVED_NAMES
from training.recipes import (
    RECIPES_DIR,
    RecipeError,
    flatten,
    list_recipes,
    load_recipe,
    parse_overrides,
    parse_value,
    validate_recipe,
)

EXPECTED = {"cifar10-vit", "cifar10-vit-cpu", "cifar10-smoke", "imdb-transformer",
            "imdb-transformer-cpu", "imdb-smoke"}


def test_every_shipped_recipe_validates_and_has_a_description() -> None:
    recipes = list_recipes()
    assert EXPECTED <= set(recipes)
    for name, desc in recipes.items():
        r = load_recipe(name)
        assert r.name == name and desc
        assert r.model.pos_encoding in ("learned", "sinusoidal", "none")
        if r.uploaded:  # a generic recipe: the user's data set, a name of the user's own
            assert r.data.dataset is None and r.register_as not in RESERVED_NAMES
        elif getattr(r, "objective", "classify") == "classify":  # pretraining registers others
            assert r.register_as in (None, "cifar10-vit", "imdb-sentiment")


def test_dotted_overrides_are_parsed_as_yaml_scalars_and_applied() -> None:
    r = load_recipe("cifar10-smoke", {
        "model.pos_encoding": "sinusoidal", "epochs": "3", "optim.lr": "1e-3",
        "optim.betas": "[0.9, 0.95]", "optim.ema_decay": "null", "augment.hflip": "false",
        "model.overrides.depth": "3", "data.subset": 64,
    })
    assert r.model.pos_encoding == "sinusoidal"
    assert r.epochs == 3 and isinstance(r.epochs, int)
    assert r.optim.lr == pytest.approx(1e-3)
    assert r.optim.betas == (0.9, 0.95)
    assert r.optim.ema_decay is None
    assert r.augment.hflip is False
    assert r.model.overrides == {"depth": 3}
    assert r.data.subset == 64
    assert load_recipe("cifar10-smoke").epochs != 3  # the file itself is untouched


@pytest.mark.parametrize("key", ["optim.lrr", "bogus", "augment.cutmix", "data.colour"])
def test_unknown_key_is_an_error_naming_it(key: str) -> None:
    with pytest.raises(RecipeError) as exc:
        load_recipe("cifar10-smoke", {key: "1"})
    assert key in str(exc.value)
    assert (key, "unknown key") in exc.value.errors


@pytest.mark.parametrize(("key", "value"), [("epochs", "abc"), ("epochs", "2.5"),
                                            ("optim.lr", "fast"), ("batch_size", "[1]"),
                                            ("device", "tpu"), ("augment.cutmix_prob", "1.5"),
                                            ("model.pos_encoding", "rotary")])
def test_wrong_type_or_value_is_an_error_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(RecipeError) as exc:
        load_recipe("cifar10-smoke", {key: value})
    assert key in [k for k, _ in exc.value.errors]


def test_several_bad_keys_are_reported_together() -> None:
    with pytest.raises(RecipeError) as exc:
        load_recipe("cifar10-smoke", {"epochs": "abc", "optim.lrr": "1"})
    keys = {k for k, _ in exc.value.errors}
    assert {"epochs", "optim.lrr"} <= keys


def test_model_overrides_are_checked_against_the_preset() -> None:
    with pytest.raises(RecipeError, match="depthh"):
        load_recipe("cifar10-smoke", {"model.overrides.depthh": "3"})
    with pytest.raises(RecipeError, match="unknown model"):
        load_recipe("cifar10-smoke", {"model.name": "vit_huge"})
    with pytest.raises(RecipeError, match="does not fit"):
        load_recipe("cifar10-smoke", {"model.name": "text_test"})


def test_unknown_recipe_lists_the_available_ones() -> None:
    with pytest.raises(RecipeError, match="cifar10-smoke"):
        load_recipe("no-such-recipe")


def test_validate_recipe_accepts_a_plain_dict_like_the_jobs_api() -> None:
    d = load_recipe("imdb-smoke").to_dict()
    assert validate_recipe(d).to_dict() == d
    d["optim"]["lr"] = "1e-4"  # YAML-1.1 style string float from a JSON client
    assert validate_recipe(d).optim.lr == pytest.approx(1e-4)


def test_override_helpers() -> None:
    assert parse_overrides(["a.b=1", "c = x"]) == {"a.b": "1", "c": "x"}
    with pytest.raises(RecipeError):
        parse_overrides(["novalue"])
    assert parse_value("1e-3") == pytest.approx(1e-3)
    assert parse_value("7") == 7
    assert parse_value("null") is None
    assert parse_value("learned") == "learned"
    # anchors and aliases are never expanded; nesting past MAX_BRACKETS is not read (PyYAML
    # took seconds on a few thousand brackets): each stays the string it was
    for text in ("&a [1]", "[*a]", "{x: &y 1, z: *y}", "[" * 101 + "]" * 101, "[" * 10**5):
        assert parse_value(text) == text
    deep = "[" * 99 + "1" + "]" * 99
    assert parse_value(deep) != deep  # within the limit: read
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": {}}) == {"a.b": 1, "a.c.d": 2, "e": {}}


def test_generic_recipes_take_an_uploaded_data_set_and_a_name() -> None:
    img = load_recipe("image-classifier-cpu", {"data.dataset": "0123456789abcdef",
                                               "register_as": "pets"})
    assert img.uploaded and img.task == "image" and img.register_as == "pets"
    txt = load_recipe("text-classifier-cpu", {"data.dataset": "0123456789abcdef"})
    assert txt.uploaded and txt.task == "text" and txt.data.val_fraction == 0.1
    for bad in ({"data.dataset": "../../etc/passwd"}, {"data.dataset": "0123456789ABCDEF"},
                {"register_as": "cifar10-vit"}, {"register_as": "a/b"},
                {"register_as": "../x"}):
        with pytest.raises(RecipeError):
            load_recipe("image-classifier-cpu", bad)
    assert not load_recipe("cifar10-smoke").uploaded
    with pytest.raises(RecipeError, match="register_as"):
        load_recipe("cifar10-smoke", {"register_as": "pets"})  # built-in data: the fixed name


@pytest.mark.parametrize(("key", "value", "says"), [
    ("epochs", True, "expected an integer, got True"),  # pydantic's lax mode read 1
    ("budget_minutes", False, "expected a number or null, got False"),
    ("augment.hflip", 1, "expected true or false, got 1"),
    ("optim.betas", [0.9, True], "expected a number, got True"),
    ("augment.resolution_schedule", [[0.5, True]], "expected an integer, got True"),
    ("init.from", 5, "expected a string or null, got 5"),
    ("model.overrides.depth", True, "depth: expected an integer"),
    ("model.overrides.pool", 3, "pool: expected one of"),
])
def test_a_json_value_of_the_wrong_type_is_refused_not_coerced(key: str, value: object,
                                                                 says: str) -> None:
    """A job body's JSON value is taken as it is: `true` is no epoch count, `1` no flag."""
    with pytest.raises(RecipeError) as exc:
        load_recipe("cifar10-smoke", {key: value})
    section = key if not key.startswith("model.") else "model"
    assert any(k == section and says in m for k, m in exc.value.errors), exc.value.errors


def test_strings_are_still_read_as_yaml_and_ints_are_numbers() -> None:
    """`--set` values are strings read by YAML rules, and an int is a valid float."""
    r = load_recipe("cifar10-smoke", {"epochs": "3", "augment.hflip": "true", "optim.lr": 1,
                                      "optim.betas": "[0.9, 0.95]", "budget_minutes": 2})
    assert (r.epochs, r.augment.hflip, r.optim.lr) == (3, True, 1.0)
    assert r.optim.betas == (0.9, 0.95) and r.budget_minutes == 2


def test_a_text_field_keeps_the_string_that_looks_like_a_number() -> None:
    """A data set id of sixteen digits (or one YAML reads as a float), a name "2024": text
    fields keep the string as sent; "null" still unsets an optional one."""
    from training.recipes import parse_override

    for key, value in (("data.dataset", "1234567890123456"), ("data.dataset", "12345678e9012345"),
                       ("register_as", "2024"), ("init.from", "123")):
        assert parse_override(key, value) == value
    assert parse_override("init.from", "null") is None
    for value in ("/data/pets #1", "a: b", "[x]", "yes", "!!str x", "--- x", "x # y", "&a x"):
        assert parse_override("data.path", value) == value  # no YAML reading of plain text
    assert parse_override("data.path", "'/a #1'") == "/a #1"
    assert parse_override("data.path", '"caf\\u00e9"') == "caf\u00e9"
    assert parse_override("data.path", "") == "" and parse_override("init.from", "~") is None
    assert parse_override("epochs", "3") == 3 and parse_override("data.pseudo_labels", "x") == "x"
    r = load_recipe("image-classifier-cpu", {"data.dataset": "1234567890123456",
                                             "register_as": "2024"})
    assert (r.data.dataset, r.register_as) == ("1234567890123456", "2024")


@pytest.mark.parametrize(("key", "value"), [
    ("description", "run 😀 # no comment: on"), ("description", "3"), ("description", "on"),
    ("description", " x\n\t\x85\u2028\ufeff '\"\\ "), ("description", ""),
    ("data.path", "/data/pets #1: cats"), ("data.dataset", "12345678e9012345"),
    ("epochs", 3), ("optim.lr", 1e-05), ("optim.lr", 1e20), ("optim.lr", -0.0),
    ("augment.hflip", True), ("budget_minutes", None), ("optim.betas", [0.9, 0.95]),
    ("data.pseudo_labels", ["a b", "1e3 x", "😀 #"]), ("data", {"path": "/x #y", "subset": 5}),
])
def test_a_typed_value_survives_the_command_line_exactly(key: str, value: object) -> None:
    """A job's stored value goes to its trainer as `--set key=<setting_text>` and is read
    back as exactly that value: YAML syntax inside a string stays text."""
    from training.recipes import parse_override, setting_text

    text = parse_overrides([f"{key}={setting_text(value)}"])[key]
    back = parse_override(key, text)
    assert back == value and type(back) is type(value), (text, back)


@pytest.mark.parametrize(("recipe", "overrides", "needle"), [
    ("imdb-mlm-smoke", {"model.overrides.student_len": 8}, "text classifiers"),
    ("imdb-smoke", {"model.overrides.student_len": 8}, "data.truncation: head_tail"),
    ("imdb-smoke", {"model.overrides.student_len": 65, "data.truncation": "head_tail"},
     "> data.max_len 64"),
])
def test_a_transformer_crop_needs_a_classifier_cut_head_tail_and_something_to_crop(
        recipe: str, overrides: dict, needle: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(needle)):
        load_recipe(recipe, overrides)
    ok = load_recipe("imdb-smoke", {"model.overrides.student_len": 16,
                                    "data.truncation": "head_tail"})
    assert ok.model.overrides["student_len"] == 16


def test_a_recipe_file_is_read_again_when_it_changes_and_never_changed_by_a_load(
        tmp_path: Path) -> None:
    """Recipe files are parsed once per version (cached by path, inode, size and times): an
    edit is seen at the next load, and one load's overrides never leak into the next."""
    path = tmp_path / "mine.yaml"
    text = (RECIPES_DIR / "cifar10-smoke.yaml").read_text()
    path.write_text(text)
    assert load_recipe(path, {"epochs": 7, "optim.lr": 0.5}).epochs == 7
    first = load_recipe(path)
    assert first.epochs != 7 and first.optim.lr != 0.5 and first.name == "mine"
    path.write_text(re.sub(r"(?m)^epochs: .*$", "epochs: 9  # edited", text))
    assert load_recipe(path).epochs == 9


def test_list_recipes_names_a_file_that_is_not_a_recipe_instead_of_failing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import training.recipes as recipes

    (tmp_path / "good.yaml").write_text((RECIPES_DIR / "cifar10-smoke.yaml").read_text())
    (tmp_path / "a-list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path)
    listed = recipes.list_recipes()
    assert listed["a-list"] == listed["broken"] == "(not a valid recipe file)"
    assert listed["good"] and not listed["good"].startswith("(")
