"""What users pass crosses as it is, on every runner (SPEC 5: "keeps its type and its values exactly"): tensor
subclasses with their attributes, nested and sparse tensors with requires_grad, small and through shared memory."""

import warnings

import pytest

from soma import Graph, NodeError
from tests.nodes import Identity

torch = pytest.importorskip("torch")

BIG = 1 << 15  # float32 elements: 128 KiB, past the inline limit (shared memory on Local)


def test_tensor_subclasses_keep_their_class_and_attributes_both_ways(runner):
    """A subclass (torchvision's BoundingBoxes is one) arrived from a Local worker as a plain tensor, its
    attributes lost, and a Parameter's subclass as a plain tensor."""
    from tests.tensor_kinds import Describe, MakeBoxes, Weight, boxes

    describe = Graph.somatize(Describe())
    for numel in (4, BIG):
        sent = boxes(torch.arange(numel, dtype=torch.float32), "XYXY")
        kind, fmt, grad, back = runner.run(describe, sent)
        assert (kind, fmt, grad) == ("Boxes", "XYXY", False), numel
        assert type(back).__name__ == "Boxes" and back.fmt == "XYXY"
        assert torch.equal(back.as_subclass(torch.Tensor), sent.as_subclass(torch.Tensor))
        made = runner.run(Graph.somatize(MakeBoxes(numel)), 3)  # made where the node runs
        assert type(made).__name__ == "Boxes" and made.fmt == "XYXY" and float(made[0]) == 3.0 and made.numel() == numel
        kind, _, grad, back = runner.run(describe, Weight(torch.ones(numel)))
        assert (kind, grad) == ("Weight", True) and type(back) is Weight and back.is_leaf and back.requires_grad
    inside = runner.run(Graph.somatize(Identity()), {"boxes": [boxes(torch.ones(BIG), "CXCYWH")], "n": 1})
    assert type(inside["boxes"][0]).__name__ == "Boxes" and inside["boxes"][0].fmt == "CXCYWH"
    if runner.copies_nodes:  # (a subclass with an autograd graph: refused as any such tensor is)
        with pytest.raises(NodeError, match="autograd graph"):
            runner.run(describe, boxes(torch.ones(3, requires_grad=True) * 2, "XYXY"))


def test_nested_and_sparse_tensors_cross_keeping_requires_grad(runner):
    """A nested tensor of strided layout failed in torch's words ("NestedTensorImpl doesn't support sizes"): it
    says strided and has no one shape, and now goes by torch's reduction; a sparse leaf lost requires_grad."""
    g = Graph.somatize(Identity())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own: nested tensors are a prototype; sparse invariant checks)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
        back = runner.run(g, nested)
        assert back.is_nested and [t.tolist() for t in back.unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), requires_grad=True)
        back = runner.run(g, sparse)
    assert back.requires_grad and torch.equal(back.detach().to_dense(), sparse.detach().to_dense())


def test_numpy_arrays_keep_their_memory_layout(runner):
    """A Fortran-ordered array, and a transposed view, came back C-ordered from Ray (the writable copy of what
    Ray's store hands back was made in C order); values were equal, the layout a user's code may rely on was not."""
    np = pytest.importorskip("numpy")
    g = Graph.somatize(Identity())
    for sent in (np.asfortranarray(np.arange(12.0).reshape(3, 4)), np.arange(12.0).reshape(3, 4).T,
                 np.asfortranarray(np.arange(1 << 16, dtype=np.float32).reshape(256, 256))):
        back = runner.run(g, sent)
        assert np.array_equal(back, sent) and back.flags.f_contiguous and not back.flags.c_contiguous
