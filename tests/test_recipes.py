"""The public docstrings that list the recipes list exactly the registry's (``mxmoe.recipes.RECIPES``)."""

import inspect
import re

import pytest

from mxmoe import MoE
from mxmoe.ops import grouped_linear
from mxmoe.recipes import RECIPES


def _recipe_arg(doc: str) -> str:
    """The text of the ``recipe:`` entry of a Google-style Args section, up to the next argument."""
    m = re.search(r"^(\s+)recipe: (.*?)(?=^\1\w+: |^\s*\w+:\n|\Z)", doc, re.S | re.M)
    assert m, "no recipe: entry in the docstring"
    return m.group(2)


@pytest.mark.parametrize("obj", [MoE, grouped_linear], ids=["MoE", "grouped_linear"])
def test_docstring_recipe_list_is_the_registry(obj):
    named = set(re.findall(r'``"(\w+)"``', _recipe_arg(inspect.getdoc(obj) or "")))
    assert named == set(RECIPES), (f"{obj.__name__}'s docstring: missing {sorted(set(RECIPES) - named)}, "
                                   f"not recipes {sorted(named - set(RECIPES))}")


def test_recipe_arg_parser_sees_a_missing_name():
    doc = 'Args:\n    recipe: ``"bf16"`` or ``"mxfp8"``.\n    validate: check.\n'
    assert set(re.findall(r'``"(\w+)"``', _recipe_arg(doc))) == {"bf16", "mxfp8"}
