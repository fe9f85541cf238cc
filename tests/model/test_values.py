import pytest

from soma import Ctx, Done, Opaque


def test_done_and_opaque_carry_their_values():
    obj = object()
    assert Done(obj).value is obj
    assert Opaque(obj).obj is obj
    assert Done(1) == Done(1) and Done(1) != Done(2)
    assert repr(Done(Opaque(3))) == "Done(Opaque(3))"


def test_ctx_fields_and_repr():
    ctx = Ctx("encoder", "cuda:0")
    assert (ctx.node, ctx.device, ctx.worker) == ("encoder", "cuda:0", None)
    assert repr(ctx) == "Ctx(node='encoder', device='cuda:0', worker=None)"
    assert repr(Ctx("a", None, "w1")) == "Ctx(node='a', device=None, worker='w1')"


def test_ctx_empty_in_process_is_torch_empty_on_the_device():
    torch = pytest.importorskip("torch")
    t = Ctx("a", "meta").empty(2, 3, dtype=torch.float16)
    assert t.device.type == "meta" and t.shape == (2, 3) and t.dtype == torch.float16
    u = Ctx("a", None).empty((4,))
    assert u.device.type == "cpu" and u.shape == (4,) and u.dtype == torch.get_default_dtype()
