"""The public API: everything in __all__ resolves, and planning alone does not import torch."""

import subprocess
import sys

import remat


def test_every_public_name_resolves():
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        remat.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'no_such_thing'" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_planning_does_not_import_torch():
    code = (
        "import sys, remat\n"
        "from remat.builders import chain_graph\n"
        "remat.solve(chain_graph(4), 2**40, method='chen_sqrtn')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
