"""The code versions a Local pool's workers may run (soma.run.codefiles.SentFiles): its workers import a node's
module once, for the first node of it each runs, so a module edited or reloaded since runs there as it was. What
the runner-independent test (tests/run/test_user_mistakes.py) cannot show: a torch model's own module, an edit
undone, and two pools. Each case below answered with code the caller's process no longer has, silently, before
Dec 7 (a tester's notebook, with IPython's %autoreload)."""

import warnings

import pytest

import soma
from tests.conftest import module_at

pytestmark = pytest.mark.timeout(120)

MODEL = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * {factor}
"""

NODE = """
from soma import Done, Node


class Versioned(Node):
    def forward(self, x, ctx):
        return Done("{version}")
"""


def said(caught) -> list[str]:
    return [str(w.message).split(", which")[0] for w in caught if issubclass(w.category, UserWarning)]


def test_a_new_node_of_a_torch_models_module_edited_since_is_warned_about(tmp_path):
    # Only the node's own methods' files were watched: soma.torch.Module's are soma's, the model's class was not.
    torch = pytest.importorskip("torch")
    from soma.torch import Module

    with module_at(tmp_path, "model_v", MODEL, factor=1) as (write, module), soma.Local(workers=1) as local:
        x = torch.ones(2)
        assert torch.equal(local.run(Module(module.Model(), name="model"), x), x)
        module = write(factor=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = local.run(Module(module.Model(), name="model"), x)
        assert torch.equal(out, x)  # (as its worker imported it: documented)
        assert said(caught) == [f"node `model` runs code of {tmp_path / 'model_v.py'}"]


def test_a_new_node_after_an_edit_undone_is_warned_about_while_a_worker_may_run_the_edit(tmp_path, monkeypatch):
    # w0 imports v1, w1 v2 (for a node sent after the edit), then the edit is undone: the file is as the pool first
    # sent it, yet w1 runs v2. Every version sent is kept.
    monkeypatch.setattr("soma.run.registry.LOOK_EVERY_S", 0.0)
    with module_at(tmp_path, "undone", NODE, version="v1") as (write, module), soma.Local(workers=2) as local:
        assert local.run(module.Versioned(), 0) == "v1"
        module = write(version="v2")
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            list(local.map(module.Versioned(), range(8)))  # (the workers may now run either)
        module = write(version="v1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert set(local.map(module.Versioned(), range(8))) <= {"v1", "v2"}
        assert said(caught) == [f"node `versioned` runs code of {tmp_path / 'undone.py'}"]


def test_a_node_sent_to_a_second_pool_after_an_edit_is_warned_about_on_the_pool_that_runs_the_old(tmp_path,
                                                                                                  monkeypatch):
    # Sending it to the second pool noted the file as it is now for the node: the first pool, whose workers run
    # the old code, was then never warned, and the second, which runs the new, was. (Not reloaded here: a class
    # replaced by importlib.reload is no longer its module's, so the old node travels by value, its old code.)
    monkeypatch.setattr("soma.run.registry.LOOK_EVERY_S", 0.0)
    with module_at(tmp_path, "two_pools", NODE, version="v1") as (write, module), \
            soma.Local(workers=1) as first, soma.Local(workers=1) as second:
        node = module.Versioned()
        assert first.run(node, 0) == "v1"
        write(reload=False, version="v2")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert second.run(node, 0) == "v2"  # (its worker imports the file as it is now: nothing to say)
        assert said(caught) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert first.run(node, 0) == "v1"
        assert said(caught) == [f"node `versioned` runs code of {tmp_path / 'two_pools.py'}"]
