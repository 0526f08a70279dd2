import pytest
import torch

from vit_service.models import (
    build_model_from_dict,
    config_to_dict,
    count_parameters,
    create_model,
    get_config,
    list_models,
)


def test_presets_are_listed() -> None:
    names = list_models()
    assert {"vit_tiny_patch4_32", "vit_small_patch4_32", "text_small", "text_base"} <= set(names)
    assert all(n.startswith("vit") for n in list_models("vit"))


@pytest.mark.parametrize("name", list_models())
def test_backward_through_every_preset(name: str) -> None:
    torch.manual_seed(0)
    m = create_model(name)
    c = m.config
    if name.startswith("vit"):
        x = torch.randn(2, 3, c.img_size, c.img_size)
    else:
        x = torch.randint(5, c.vocab_size, (2, 16))
    loss = m(x).logsumexp(-1).mean()
    loss.backward()
    n = count_parameters(m)
    print(f"{name}: {n / 1e6:.2f}M parameters")
    assert n > 0
    missing = [k for k, p in m.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient reached {missing}"


def test_overrides_and_unknown_names() -> None:
    m = create_model("vit_test", num_classes=3, pos_encoding="sinusoidal")
    assert m.config.num_classes == 3 and m.config.pos_encoding == "sinusoidal"
    with pytest.raises(KeyError, match="unknown model"):
        create_model("nope")
    with pytest.raises(TypeError, match="unknown override"):
        get_config("vit_test", embed_dimm=3)


def test_config_round_trip_rebuilds_the_same_model() -> None:
    m = create_model("text_test", pool="mean")
    d = config_to_dict(m.config)
    assert d["arch"] == "text" and d["pool"] == "mean"
    m2 = build_model_from_dict(d)
    m2.load_state_dict(m.state_dict())
    ids = torch.randint(5, 1000, (2, 9))
    torch.testing.assert_close(m.eval()(ids), m2.eval()(ids))


@pytest.mark.parametrize(("override", "says"), [
    ({"depth": True}, "depth: expected an integer, got True"),  # a dataclass would build 1
    ({"depth": "3"}, "depth: expected an integer, got '3'"),  # range("3") deep in the build
    ({"pool": 3}, "pool: expected one of 'cls', 'mean', got 3"),
    ({"pool": "max"}, "got 'max'"), ({"qkv_bias": "no"}, "qkv_bias: expected true or false"),
    ({"drop_rate": True}, "drop_rate: expected a number"),
])
def test_an_override_of_the_wrong_type_names_the_field(override: dict, says: str) -> None:
    with pytest.raises(ValueError) as e:
        get_config("vit_test", **override)
    assert says in str(e.value)
    assert get_config("vit_test", drop_rate=0, mlp_ratio=2).mlp_ratio == 2  # an int is a float
