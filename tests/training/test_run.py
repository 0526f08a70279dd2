"""The run entry points' options (``training.run.RunOptions``): shared by ``train`` and
``prepare_run`` as one typed set of keywords, and a misspelt one is still an error."""

from __future__ import annotations

import pytest

from training.recipes import load_recipe
from training.run import prepare_run, train


@pytest.mark.parametrize("entry", [train, prepare_run])
def test_a_misspelt_option_is_an_error_before_anything_runs(entry) -> None:
    # a self-training recipe: train() would start its teachers first, so the check comes before
    recipe = load_recipe("imdb-smoke", {"data.include_unsup": True,
                                        "data.pseudo_labels": "teacher"})
    with pytest.raises(TypeError, match="unknown run options: registr"):
        entry(recipe, registr=False)
