"""`--pretrained` in every form the docs show (a run directory, a checkpoint directory, a checkpoint's own
model.safetensors) takes the checkpoint's DINO model options the same way, and a value the run sets itself, also one
equal to vtrain's default, counts as set (engine/pretrained.py, `cfg.given`). The checkpoints: runs written with the
checkpoint API with the options of two published codebases, and real `vtrain convert` outputs of the IDEA-Research
DINO and mmdetection fixtures (tests/fixtures/); the detector built with the taken options loads the checkpoint's
weights strictly."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.helpers.checkpoints import weights_run
from vtrain.config import build_config
from vtrain.engine.pretrained import inherit_model_options, resolve
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict
from vtrain.tasks import build_model

MODEL = {"preset": "debug-resnet", "image_size": 128, "num_queries": 20, "dn_queries": 0}
# what `vtrain convert` records from each source (docs/detection.md "Model options"), vtrain's defaults otherwise
SOURCES = {
    "mmdet-like": {"mask_invalid_proposals": False, "box_eps": 1e-5, "clip_boxes": True},
    "idea-like": {"neck_bias": True, "mask_invalid_proposals": False},
}
CATEGORIES = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
FORMS = {
    "run directory": lambda ck: ck.parent.parent,
    "checkpoint directory": lambda ck: ck,
    "its model.safetensors": lambda ck: ck / "model.safetensors",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, options in SOURCES.items():
        cfg = build_config("dino", overrides={"model": {**MODEL, **options}, "train": {"output_dir": str(root)}})
        out[name] = weights_run(root / name, cfg, build_model("dino", cfg.model, 2).state_dict(), CATEGORIES)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`vtrain convert` of the IDEA DINO and mmdetection fixtures (their small Swin preset, as convert's tests use)."""
    from tests.helpers.paths import FIXTURES
    from tests.helpers.peers import TINY
    from vtrain.presets import DINO_PRESETS
    from vtrain.tools.convert import convert

    root = tmp_path_factory.mktemp("converted")
    mp = pytest.MonkeyPatch()
    mp.setitem(DINO_PRESETS, "peer-tiny", lambda: TINY)
    out = {}
    for name, file, source in (("idea", "idea/checkpoint.pth", "idea-dino"), ("mmdet", "mmdet/model.pth",
                                                                              "mmdet-dino")):
        convert(FIXTURES / file, root / name, source, "peer-tiny")
        out[name] = root / name
    yield out
    mp.undo()


@pytest.mark.parametrize("source", ["idea", "mmdet"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_converted_run_in_every_form(converted, source, form):
    from vtrain.config import load_run_config

    run = converted[source]
    ckpt = run / "checkpoints" / "step_0"
    given = FORMS[form](ckpt)
    cfg = build_config("dino", overrides={"model": {"preset": "peer-tiny", "image_size": 128,
                                                    "pretrained": str(given)}})
    assert inherit_model_options(cfg) is not None
    saved = load_run_config(ckpt / "config.yaml").model
    for f in ("neck_bias", "pos_temperature", "pos_offset", "mask_invalid_proposals", "box_eps", "clip_boxes"):
        assert getattr(cfg.model, f) == getattr(saved, f), (source, form, f)
    src = resolve(given)
    model = build_model("dino", cfg.model, len(src.categories))
    load_strict(model, load_file(str(src.weights)), "--pretrained", "does not fit")


def _fine_tune(pretrained, file_values=None, **model):
    return build_config("dino", file_values, {"model": {**MODEL, **model, "pretrained": str(pretrained)}})


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_takes_the_checkpoints_model_options(runs, source, form):
    cfg = _fine_tune(FORMS[form](runs[source]))
    line = inherit_model_options(cfg)
    assert line is not None and str(runs[source]) in line, line
    for key, value in SOURCES[source].items():
        assert getattr(cfg.model, key) == value, (form, key)
    src = resolve(cfg.model.pretrained)
    assert src.categories == CATEGORIES
    model = build_model("dino", cfg.model, 2)  # its weights fit the model of the taken options (neck biases too)
    load_strict(model, load_file(str(src.weights)), "--pretrained", "does not fit")


@pytest.mark.parametrize("where", ["--config file", "flag"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_value_set_to_vtrains_default_is_set(runs, form, where):
    """box_eps 1e-3 is vtrain's default; given in the --config file or as a flag it is the run's choice, not
    "unset"."""
    at = FORMS[form](runs["mmdet-like"])
    cfg = _fine_tune(at, {"model": {"box_eps": 1e-3}}) if where == "--config file" else _fine_tune(at, box_eps=1e-3)
    with pytest.raises(VtrainError) as e:
        inherit_model_options(cfg)
    assert "model.box_eps: this run 0.001, the checkpoint 1e-05" in str(e.value) and "\n" not in str(e.value)
    # a value equal to the checkpoint's is no clash; the options left unset are taken
    cfg = _fine_tune(FORMS[form](runs["mmdet-like"]), {"model": {"box_eps": 1e-5}})
    assert "clip_boxes=True" in inherit_model_options(cfg) and cfg.model.box_eps == 1e-5


def test_a_plain_weights_file_takes_no_options(runs, tmp_path):
    import shutil

    plain = tmp_path / "weights.safetensors"
    shutil.copy(runs["idea-like"] / "model.safetensors", plain)
    cfg = _fine_tune(plain)
    assert inherit_model_options(cfg) is None and cfg.model.neck_bias is False and resolve(plain).categories is None
