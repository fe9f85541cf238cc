"""The DSL and the Graph: ids, edges, placement, and what a failed call leaves behind."""

import pytest

import soma
from soma import DeviceError, Graph, GraphError, Node
from tests.nodes import AddOne, Count, Double, Identity, Tokenize, Upper


class HTTPFetch(Node):
    def forward(self, x, ctx):
        return soma.Done(x)


class Encoder(Identity):
    pass


class Other(Identity):
    pass


def seed_graph():
    return Graph.somatize(Tokenize() >> (Encoder().on("cuda:0") | Other().on("cuda:1")) >> Identity().named("join"))


def test_seed_example_shape():
    g = seed_graph()
    assert g.nodes() == ["tokenize", "encoder", "other", "join"]
    assert g.devices() == {"encoder": "cuda:0", "other": "cuda:1"}
    assert str(g.plan()) == "tokenize >> (encoder | other) >> join"
    assert g.edges() == [("tokenize", "encoder"), ("tokenize", "other"), ("encoder", "join"), ("other", "join")]


def test_repr_shows_ids_and_placements():
    assert repr(seed_graph()) == "Graph(tokenize >> (encoder.on('cuda:0') | other.on('cuda:1')) >> join)"


def test_default_ids_are_snake_case_class_names():
    g = Graph.somatize(HTTPFetch() >> Tokenize())
    assert g.nodes() == ["http_fetch", "tokenize"]


def test_repeated_default_ids_get_suffixes_in_order():
    g = Graph.somatize(Identity() >> Identity() >> (Identity() | Upper()))
    assert g.nodes() == ["identity", "identity_2", "identity_3", "upper"]


def test_default_ids_skip_explicit_ones():
    g = Graph.somatize(Identity().named("identity_2") >> Identity() >> Identity())
    assert g.nodes() == ["identity_2", "identity", "identity_3"]


def test_named_sets_the_id():
    g = Graph.somatize(Tokenize().named("tok") >> Upper())
    assert g.nodes() == ["tok", "upper"]


def test_two_equal_explicit_ids_are_an_error():
    with pytest.raises(GraphError, match="two nodes are named `enc`"):
        Graph.somatize(Identity().named("enc") >> Upper().named("enc"))


@pytest.mark.parametrize("bad", ["1abc", "has space", "with-dash", "", "ünïcode-é"])
def test_non_identifier_id_is_an_error(bad):
    with pytest.raises(GraphError, match="identifier-like"):
        Identity().named(bad)


def test_same_instance_twice_is_an_error():
    node = Identity()
    with pytest.raises(GraphError, match="same Node instance"):
        Graph.somatize(node >> Upper() >> node)
    with pytest.raises(GraphError, match="same Node instance"):
        Graph.somatize(node.on("cpu") | node.named("x"))


def test_named_on_a_composite_is_an_error():
    with pytest.raises(GraphError, match=r"names one node.*composite"):
        (Identity() >> Upper()).named("x")


def test_named_and_on_commute():
    a = Graph.somatize(Identity().named("x").on("meta") >> Upper())
    b = Graph.somatize(Identity().on("meta").named("x") >> Upper())
    assert a.nodes() == b.nodes() == ["x", "upper"]
    assert a.devices() == b.devices() == {"x": "meta"}


def test_on_spreads_over_the_whole_piece_and_the_innermost_wins():
    g = Graph.somatize((Identity().on("cuda:0") >> (Upper() | Count())).on("cuda:1") >> Identity().named("join"))
    assert g.devices() == {"identity": "cuda:0", "upper": "cuda:1", "count": "cuda:1"}


def test_each_branch_in_its_own_place_and_unplaced_stays_unplaced():
    g = Graph.somatize(Tokenize() >> (Upper().on("meta") | Count().on("cpu") | Identity()) >> Identity().named("join"))
    assert g.devices() == {"upper": "meta", "count": "cpu"}
    assert g.device("identity") is None
    assert "identity" not in g.devices()


def test_on_validates_right_there():
    with pytest.raises(DeviceError, match="unknown kind `cude`"):
        Identity().on("cude:0")
    with pytest.raises(DeviceError, match="needs an index"):
        (Identity() >> Upper()).on("cuda")


def test_on_and_place_give_the_same_graph():
    declared = Graph.somatize(Tokenize() >> Upper().on("meta") >> Count().on("cpu"))
    placed = Graph.somatize(Tokenize() >> Upper() >> Count())
    placed.place("upper", "meta")
    placed.place("count", "cpu")
    assert placed.devices() == declared.devices()
    assert repr(placed) == repr(declared)
    assert placed.plan() == declared.plan()


def test_placing_afterwards_in_a_loop_and_replacing_overwrites():
    g = Graph.somatize(Identity() >> Identity() >> Identity())
    for i, nid in enumerate(g.nodes()):
        g.place(nid, "meta" if i % 2 else "cpu")
    assert g.devices() == {"identity": "cpu", "identity_2": "meta", "identity_3": "cpu"}
    g.place("identity_2", "cuda:3")
    assert g.devices()["identity_2"] == "cuda:3"
    g.place("identity_2", None)
    assert "identity_2" not in g.devices()


def test_placing_an_unknown_node_lists_the_known_ids():
    g = Graph.somatize(Tokenize() >> Upper())
    with pytest.raises(GraphError, match=r"no node `encoder` in this graph; its nodes are: tokenize, upper"):
        g.place("encoder", "cpu")


@pytest.mark.parametrize(
    "bad, message",
    [
        ("cude:0", r"^unknown kind `cude` \(expected cpu, cuda:N or meta\) \(placing node `upper`\)$"),
        ("cuda", r"^`cuda` needs an index, write `cuda:0` \(placing node `upper`\)$"),
        ("cuda:x", r"^not shaped like a device: `cuda:x`.*\(placing node `upper`\)$"),
        ("cpu:0", r"^not shaped like a device: `cpu:0`.*\(placing node `upper`\)$"),
    ],
)
def test_each_bad_device_has_its_own_message_and_changes_nothing(bad, message):
    g = Graph.somatize(Tokenize() >> Upper().on("meta"))
    with pytest.raises(DeviceError, match=message):
        g.place("upper", bad)
    assert g.devices() == {"upper": "meta"}


def test_failed_place_of_unknown_id_changes_nothing():
    g = Graph.somatize(Tokenize().on("cpu") >> Upper())
    before = g.devices()
    with pytest.raises(GraphError):
        g.place("nope", "meta")
    assert g.devices() == before


def test_node_returns_the_object_and_unknown_id_is_an_error():
    tok = Tokenize()
    g = Graph.somatize(tok >> Upper())
    assert g.node("tokenize") is tok
    with pytest.raises(GraphError, match="no node `x`"):
        g.node("x")


def test_somatize_a_single_node():
    g = Graph.somatize(Identity().on("meta"))
    assert g.nodes() == ["identity"]
    assert g.edges() == []
    assert str(g.plan()) == "identity"
    assert g.run(5) == 5


def test_somatize_rejects_other_things():
    with pytest.raises(GraphError, match="needs a soma Node"):
        Graph.somatize(42)


def test_composing_with_a_non_node_says_to_use_fn():
    with pytest.raises(GraphError, match=r"wrap a plain function with soma.fn"):
        Identity() >> len
    with pytest.raises(GraphError, match=r"wrap a plain function with soma.fn"):
        len >> Identity()
    with pytest.raises(GraphError, match=r"^cannot compose identity \| int 3: both sides of `\|` must be soma nodes "
                                         r"or expressions$"):
        Identity() | 3  # not a function: no soma.fn hint


def test_operators_flatten():
    a, b, c = AddOne(), Double(), Identity()
    assert str(Graph.somatize((a >> b) >> c).plan()) == "add_one >> double >> identity"
    a, b, c = AddOne(), Double(), Identity()
    assert str(Graph.somatize(a >> (b >> c)).plan()) == "add_one >> double >> identity"
    a, b, c = AddOne(), Double(), Identity()
    assert str(Graph.somatize((a | b) | c).plan()) == "add_one | double | identity"
    a, b, c = AddOne(), Double(), Identity()
    assert str(Graph.somatize(a | (b | c)).plan()) == "add_one | double | identity"
    a, b, c = AddOne(), Double(), Identity()
    assert str(Graph.somatize((a >> b) | c).plan()) == "(add_one >> double) | identity"


def test_edges_of_nested_expressions():
    g = Graph.somatize(AddOne() >> ((Double() >> Identity()) | Count()) >> Identity().named("join"))
    assert sorted(g.edges()) == sorted([
        ("add_one", "double"), ("double", "identity"), ("add_one", "count"),
        ("identity", "join"), ("count", "join"),
    ])


def test_fn_nodes_take_the_function_name_and_wrap_in_done():
    def shout(x):
        return x.upper()

    def with_ctx(x, ctx):
        return (x, ctx.node, ctx.device)

    g = Graph.somatize(soma.fn(shout) >> soma.fn(with_ctx).on("cpu"))
    assert g.nodes() == ["shout", "with_ctx"]
    assert g.run("hi") == ("HI", "with_ctx", "cpu")


def test_fn_lambda_needs_a_name():
    with pytest.raises(GraphError, match=r"lambda.*needs name="):
        soma.fn(lambda x: x)
    g = Graph.somatize(soma.fn(lambda x: x + 1, name="inc") >> soma.fn(lambda x: x * 10, name="inc"))
    assert g.nodes() == ["inc", "inc_2"]
    assert g.run(1) == 20


def test_fn_that_returns_done_is_not_wrapped_twice():
    g = Graph.somatize(soma.fn(lambda x: soma.Done(x + 1), name="inc"))
    assert g.run(1) == 2


def test_fn_refuses_async_and_generator_functions_and_passes_a_keyword_only_ctx_by_name():
    """An `async def` or a generator function as a node: a TypeError at soma.fn, saying what to write instead (the
    Executor returned the coroutine or generator object as the output; Local said it could not pickle it). A
    keyword-only `ctx` is passed by name (it was passed second, positionally: a TypeError at run time)."""
    async def embed(x):
        return x

    def lines(x):
        yield x

    async def stream(x):
        yield x

    class Awaits:
        async def __call__(self, x):
            return x

    for func, kind in ((embed, "an async def function"), (lines, "a generator function"), (stream, "an async def"),
                       (Awaits(), "an async def")):
        with pytest.raises(TypeError, match=f"^soma.fn\\(.*\\): it is {kind}.* make it a plain def"):
            soma.fn(func)

    def device_of(x, *, ctx):
        return (x, ctx.node)

    assert soma.Executor().run(soma.fn(device_of), 1) == (1, "device_of")


def test_fn_of_a_builtin_without_signature():
    g = Graph.somatize(soma.fn(len))
    assert g.nodes() == ["len"]
    assert g.run([1, 2, 3]) == 3


def test_parameters_are_collected_once_in_node_order():
    class P(Node):
        def __init__(self, *params):
            self.params = params

        def parameters(self):
            return iter(self.params)

        def forward(self, x, ctx):
            return soma.Done(x)

    shared = object()
    a, b = object(), object()
    g = Graph.somatize(P(a, shared) >> Identity() >> P(shared, b))
    assert g.parameters() == [a, shared, b]


def test_a_subclass_need_not_call_node_init():
    class NoInit(Node):
        def __init__(self, k):
            self.k = k  # no super().__init__()

        def forward(self, x, ctx):
            return soma.Done(x * self.k)

    g = Graph.somatize(NoInit(3).on("cpu") >> NoInit(2).named("two"))
    assert g.nodes() == ["no_init", "two"]
    assert g.run(1) == 6
