"""What a newcomer trips over in the first ten minutes (issue 13): messages that say what went wrong, exactly."""

import re

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
     "cannot compose class Tokenize >> tokenize: `Tokenize` is a Node class, not a node: did you mean `Tokenize()`?"),
    (lambda: Tokenize() >> Tokenize,
     "cannot compose tokenize >> class Tokenize: `Tokenize` is a Node class, not a node: did you mean `Tokenize()`?"),
    (lambda: Tokenize | Tokenize(),
     "cannot compose class Tokenize | tokenize: `Tokenize` is a Node class, not a node: did you mean `Tokenize()`?"),
    (lambda: Graph.somatize(Tokenize),
     "Graph.somatize needs a soma Node or an expression built with >> and |, got type: "
     "`Tokenize` is a Node class, not a node: did you mean `Tokenize()`?"),
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
