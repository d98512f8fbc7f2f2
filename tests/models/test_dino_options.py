"""DINO model options for faithful imports (DinoOptions, ModelConfig's fields of the same names): defaults are
vtrain's recipe, each option does what its docstring says (docs/detection.md "Model options")."""

import dataclasses
import math

import pytest
import torch

from vtrain.config import ConfigError, ModelConfig, build_config
from vtrain.models.dino import DINO, DinoOptions, postprocess
from vtrain.models.dino.transformer import sine_position_2d
from vtrain.tasks.model import dino_options


def test_defaults_are_todays_model():
    assert dino_options(ModelConfig()) == DinoOptions()
    model = DINO("debug", 3)
    assert all(m[0].bias is None for m in [*model.neck.lateral, *model.neck.extra])
    assert model.decoder.refine_eps == 1e-3


def test_config_fields_reach_the_model():
    names = {f.name for f in dataclasses.fields(DinoOptions)}
    assert names <= {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(neck_bias=True, pos_temperature=10000.0, pos_offset=-0.5, refine_eps=1e-4, box_eps=1e-5,
                    clip_boxes=True, mask_invalid_proposals=False, pos_normalize=False)
    assert dataclasses.asdict(dino_options(m)) == {f: getattr(m, f) for f in names}


@pytest.mark.parametrize("field,value", [("refine_eps", 0.0), ("refine_eps", 0.7), ("box_eps", 0.0), ("pos_temperature", -1.0),
                                         ("pos_temperature", float("nan")), ("pos_offset", 3.0)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        build_config("dino", overrides={"model": {field: value}})


def test_neck_bias_zero_gives_the_model_without_bias():
    torch.manual_seed(0)
    plain = DINO("debug", 3).eval()
    biased = DINO("debug", 3, options=DinoOptions(neck_bias=True)).eval()
    sd = biased.state_dict()
    extra = sorted(set(sd) - set(plain.state_dict()))
    assert extra and all(k.startswith("neck.") and k.endswith(".0.bias") for k in extra)
    assert all(sd[k].abs().max() == 0 for k in extra)  # initialised to zero
    biased.load_state_dict({**plain.state_dict(), **{k: sd[k] for k in extra}})
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        a, b = plain(x), biased(x)
        assert torch.equal(a["pred_logits"], b["pred_logits"])
        for k in extra:
            sd[k].normal_()
        biased.load_state_dict(sd)
        assert not torch.allclose(biased(x)["pred_logits"], a["pred_logits"])


def _sine_reference(mask, feats, temperature, offset):
    """The published normalised sine embedding (DETR / Deformable-DETR's PositionEmbeddingSine with offset)."""
    not_mask = (~mask).float()
    y, x = not_mask.cumsum(1), not_mask.cumsum(2)
    y = (y + offset) / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = (x + offset) / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    dim_t = temperature ** (2 * (torch.arange(feats) // 2) / feats)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack([px[..., 0::2].sin(), px[..., 1::2].cos()], -1).flatten(3)
    py = torch.stack([py[..., 0::2].sin(), py[..., 1::2].cos()], -1).flatten(3)
    return torch.cat([py, px], -1).permute(0, 3, 1, 2)


@pytest.mark.parametrize("temperature,offset", [(20.0, 0.0), (10000.0, -0.5)])
def test_sine_positions_follow_temperature_and_offset(temperature, offset):
    mask = torch.zeros(2, 6, 9, dtype=torch.bool)
    mask[1, 4:] = True
    mask[1, :, 7:] = True
    got = sine_position_2d(mask, 16, temperature, offset)
    assert torch.allclose(got, _sine_reference(mask, 16, temperature, offset), atol=1e-6)
    other = sine_position_2d(mask, 16, 20.0 if temperature != 20.0 else 10000.0, offset)
    assert (got - other).abs().max() > 1.0  # the temperature matters: a wrong one is no rounding error
    raw = sine_position_2d(mask, 16, temperature, offset, normalize=False)
    assert torch.allclose(raw[:, 0], (~mask).float().cumsum(1).sin())  # first y channel: sin(row index)


@pytest.mark.parametrize("field", ["refine_eps", "box_eps"])
def test_eps_reaches_the_boxes(field):
    torch.manual_seed(0)
    a = DINO("debug", 3).eval()
    b = DINO("debug", 3, options=DinoOptions(**{field: 1e-5})).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for h in a.reg_heads:  # push the boxes to the edge, where the inverse sigmoid's clamp acts
            h.layers[-1].bias.fill_(8.0)
        b.load_state_dict(a.state_dict())
        x = torch.randn(1, 3, 96, 128)
        # refine_eps moves the reference points the last decoder layer samples at (so its logits), box_eps the boxes
        key = "pred_logits" if field == "refine_eps" else "pred_boxes"
        ba, bb = a(x)[key], b(x)[key]
    assert b.decoder.refine_eps == (1e-5 if field == "refine_eps" else 1e-3) and not torch.equal(ba, bb)


def test_clip_boxes():
    logits = torch.tensor([[[5.0]]])
    boxes = torch.tensor([[[0.9, 0.5, 0.6, 0.2]]])  # xyxy (0.6, 0.4, 1.2, 0.6) of the image
    size = torch.tensor([[100, 200]])
    assert postprocess(logits, boxes, size)[0]["boxes"][0, 2] == pytest.approx(240.0)
    clipped = postprocess(logits, boxes, size, clip=True)[0]["boxes"][0]
    assert clipped.tolist() == pytest.approx([120.0, 40.0, 200.0, 60.0])
