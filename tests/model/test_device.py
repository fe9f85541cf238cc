import pytest

from soma import Device, DeviceError


@pytest.mark.parametrize("text", ["cpu", "meta", "cuda:0", "cuda:12"])
def test_valid_devices_round_trip(text):
    device = Device.parse(text)
    assert str(device) == text
    assert Device.parse(str(device)) == device


def test_parse_gives_kind_and_index():
    assert Device.parse("cuda:3") == Device("cuda", 3)
    assert Device.parse("cpu") == Device("cpu")
    assert Device.parse("meta").index is None


def test_unknown_kind():
    with pytest.raises(DeviceError, match=r"^unknown kind `cude` \(expected cpu, cuda:N or meta\)$"):
        Device.parse("cude:0")


def test_cuda_needs_an_index():
    with pytest.raises(DeviceError, match=r"^`cuda` needs an index, write `cuda:0`$"):
        Device.parse("cuda")


@pytest.mark.parametrize("text", ["cuda:", "cuda:x", "cuda:1:2", "cpu:0", "", "cuda:-1"])
def test_not_shaped_like_a_device(text):
    with pytest.raises(DeviceError, match=r"^not shaped like a device") as info:
        Device.parse(text)
    assert f"`{text}`" in str(info.value)


def test_device_error_is_a_value_error():
    with pytest.raises(ValueError):
        Device.parse("gpu:0")


def test_non_string_is_a_device_error_naming_the_type():
    with pytest.raises(DeviceError, match="not int 0"):
        Device.parse(0)


def test_a_torch_device_parses_the_same():
    torch = pytest.importorskip("torch")
    assert Device.parse(torch.device("cuda:1")) == Device("cuda", 1)
    with pytest.raises(DeviceError, match="needs an index"):
        Device.parse(torch.device("cuda"))


def test_device_hands_to_torch_untranslated():
    torch = pytest.importorskip("torch")
    t = torch.empty(2, device=str(Device.parse("meta")))
    assert t.device.type == "meta"
