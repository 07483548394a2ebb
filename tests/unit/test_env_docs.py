"""docs/environment.md is what tools/gen_env_docs.py renders from deepinfer/envs.py: a variable added,
renamed or re-defaulted in envs.py fails here until the page is regenerated."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_env_docs", os.path.join(REPO, "tools", "gen_env_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_environment_page_is_generated_from_envs():
    gen = _generator()
    page = open(os.path.join(REPO, "docs", "environment.md")).read()
    assert page == gen.render(), "docs/environment.md is out of date: run python tools/gen_env_docs.py"


def test_every_variable_has_a_row():
    from deepinfer import envs

    page = open(os.path.join(REPO, "docs", "environment.md")).read()
    for name in envs.VARS:
        assert f"| `{name}` |" in page, name
