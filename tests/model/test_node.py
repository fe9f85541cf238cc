"""What a newcomer trips over in the first ten minutes (issue 13): messages that say what went wrong, exactly."""

import re
import subprocess
import sys

import pytest

import soma
from soma import Done, Graph, GraphError, Node
from tests.nodes import Identity, Tokenize


def upper(x):
    return x.upper()


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


# -- composing with something that is not a node ----------------------------------------------------

NOT_A_NODE = [  # (what the user wrote, the exact message)
    (lambda: upper >> Tokenize(),
     "cannot compose function upper >> tokenize: both sides of `>>` must be soma nodes or expressions "
     "(wrap a plain function with soma.fn: `soma.fn(upper)`)"),
    (lambda: upper | Tokenize(),
     "cannot compose function upper | tokenize: both sides of `|` must be soma nodes or expressions "
     "(wrap a plain function with soma.fn: `soma.fn(upper)`)"),
    (lambda: Tokenize() >> Identity() >> upper,
     "cannot compose tokenize >> identity >> function upper: both sides of `>>` must be soma nodes or "
     "expressions (wrap a plain function with soma.fn: `soma.fn(upper)`)"),
    (lambda: 3 >> Tokenize(),  # not callable: no soma.fn hint
     "cannot compose int 3 >> tokenize: both sides of `>>` must be soma nodes or expressions"),
    (lambda: (lambda x: x) | Tokenize(),
     "cannot compose function <lambda> | tokenize: both sides of `|` must be soma nodes or expressions "
     "(wrap a plain function with soma.fn: `soma.fn(f, name=\"...\")`)"),
    (lambda: Tokenize >> Tokenize(),
     "cannot compose class Tokenize >> tokenize: both sides of `>>` must be soma nodes or expressions (`Tokenize` "
     "is a Node class, not a node: did you mean `Tokenize()`?)"),
    (lambda: Tokenize() >> Tokenize,
     "cannot compose tokenize >> class Tokenize: both sides of `>>` must be soma nodes or expressions (`Tokenize` "
     "is a Node class, not a node: did you mean `Tokenize()`?)"),
    (lambda: Tokenize | Tokenize(),
     "cannot compose class Tokenize | tokenize: both sides of `|` must be soma nodes or expressions (`Tokenize` "
     "is a Node class, not a node: did you mean `Tokenize()`?)"),
    (lambda: Graph.somatize(Tokenize),
     "Graph.somatize needs a soma Node or an expression built with >> and |; got class Tokenize (`Tokenize` is a "
     "Node class, not a node: did you mean `Tokenize()`?)"),
    (lambda: Graph.somatize(upper),  # the same words as every runner's run and map (SPEC 7)
     "Graph.somatize needs a soma Node or an expression built with >> and |; got function upper (wrap a plain "
     "function with soma.fn: `soma.fn(upper)`)"),
]


@pytest.mark.parametrize("written, message", NOT_A_NODE)
def test_composing_with_what_is_not_a_node_names_both_sides_in_the_order_written(written, message):
    with pytest.raises(GraphError, match=exact(message)):
        written()


# -- forward(x, ctx) is checked when the graph is built ----------------------------------------------

class NoCtx(Node):
    def forward(self, x):
        return Done(x)


class ThreeArgs(Node):
    def forward(self, x, ctx, extra):
        return Done(x)


class KeywordOnly(Node):
    def forward(self, *, x, ctx):
        return Done(x)


def test_forward_without_ctx_is_a_graph_error_naming_the_node():
    with pytest.raises(GraphError, match=exact(
            "node `no_ctx` (NoCtx): soma calls forward(x, ctx), but NoCtx.forward(self, x) cannot be called that "
            "way (too many positional arguments); define it as `def forward(self, x, ctx)`")):
        Graph.somatize(Tokenize() >> NoCtx())
    with pytest.raises(GraphError, match=exact(
            "node `more` (ThreeArgs): soma calls forward(x, ctx), but ThreeArgs.forward(self, x, ctx, extra) cannot "
            "be called that way (missing a required argument: 'extra'); define it as `def forward(self, x, ctx)`")):
        Graph.somatize(ThreeArgs().named("more"))
    with pytest.raises(GraphError, match=r"^node `keyword_only` \(KeywordOnly\): soma calls forward\(x, ctx\)"):
        Graph.somatize(KeywordOnly())


class CtxDefault(Node):
    def forward(self, x, ctx=None):
        return Done(("default", x))


class Star(Node):
    def forward(self, *args):
        return Done(("star", args[0]))


class Rest(Node):
    def forward(self, x, *rest):
        return Done(("rest", x))


class Static(Node):
    @staticmethod
    def forward(x, ctx):
        return Done(("static", x))


class Builtin(Node):
    forward = staticmethod(print)  # no signature to read: accepted, as before


def test_every_forward_that_takes_x_and_ctx_is_accepted_and_runs():
    g = Graph.somatize(CtxDefault() | Star() | Rest() | Static() | soma.fn(upper))
    assert g.run("a") == (("default", "a"), ("star", "a"), ("rest", "a"), ("static", "a"), "A")
    assert Graph.somatize(Builtin()).nodes() == ["builtin"]


# -- the README, pasted as it is ---------------------------------------------------------------------

from tests.conftest import ROOT  # noqa: E402


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readmes_first_snippet_runs_as_pasted_and_prints_what_its_comments_say():
    first = readme_blocks("python")[0]
    done = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    promised = [line.split("# ", 1)[1] for line in first.splitlines() if line.startswith("print(")]
    assert done.stdout.splitlines() == promised


def test_the_seed_example_follows_it_and_builds_without_a_gpu():
    first, second = readme_blocks("python")[:2]
    assert 'Encoder().on("cuda:0") | Other().on("cuda:1")' in second
    namespace: dict = {}
    exec(compile(first + second, "README.md", "exec"), namespace)  # prints the first snippet's lines again
    g = namespace["g"]
    assert g.nodes() == ["tokenize", "encoder", "other", "join"]
    assert g.devices() == {"encoder": "cuda:0", "other": "cuda:1"}
    assert str(g.plan()) == "tokenize >> (encoder | other) >> join"


def test_numpy_comes_wherever_torch_does():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("torch", "test"):
        assert any(r.startswith("torch") for r in extras[name]) and "numpy" in extras[name], name
    installs = [line for block in readme_blocks("bash") for line in block.splitlines() if "torch==" in line]
    installs += re.findall(r"`(pip install torch[^`]*)`", (ROOT / "README.md").read_text())
    assert installs and all("pip install torch==2.13.0 numpy" in line for line in installs), installs
