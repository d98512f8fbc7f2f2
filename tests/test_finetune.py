"""Fine-tuning from a vtrain checkpoint on other classes (`vtrain train --pretrained CKPT`): a tiny DINO trained 2
steps on the demo shapes, then fine-tuned on a COCO set of other classes, some with the same names. Every tensor but
the class rows is the checkpoint's; class rows of classes named in both lists are the checkpoint's rows; the others
are the new model's recipe initialisation (class bias at prior 0.01); one log line says so."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ok, vtrain
from vtrain.models.dino.class_rows import RowPlan, class_keys, plan_rows

BASE = ["--task", "dino", "--model", "debug-resnet", "--num-workers", "0", "--mixed-precision", "no",
        "--image-size", "128", "--batch-size", "2", "--schedule", "constant"]
# the new set's classes, by COCO id: two names the demo also has ("Square" differs in case), three it has not
NEW_CATEGORIES = [{"id": 10, "name": "Square"}, {"id": 20, "name": "hexagon"}, {"id": 30, "name": "circle"},
                  {"id": 40, "name": "star"}, {"id": 50, "name": "blob"}]
PRIOR_BIAS = -math.log((1 - 0.01) / 0.01)  # DINO's class bias: prior probability 0.01 (docs/dino.md)


def _subset(categories: list[dict] | None, n_images: int = 2) -> dict:
    """The first demo training images as a COCO dict; with `categories`, their boxes relabelled onto them."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    images = d["images"][:n_images]
    ids = {im["id"] for im in images}
    anns = [dict(a) for a in d["annotations"] if a["image_id"] in ids]
    if categories is not None:
        for i, a in enumerate(anns):
            a["category_id"] = categories[i % len(categories)]["id"]
    return {"images": images, "annotations": anns, "categories": categories or d["categories"]}


def _data_flags(ann: Path) -> list[str]:
    from vtrain.data.demo_shapes import ensure_demo_shapes

    images = str(ensure_demo_shapes() / "train2017")
    return ["--train-ann", str(ann), "--train-images", images, "--val-ann", str(ann), "--val-images", images]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """A 2-step debug-resnet run on the demo classes, and annotation files: the demo's and the new classes'."""
    root = tmp_path_factory.mktemp("finetune")
    demo_ann, new_ann = root / "demo.json", root / "new.json"
    demo_ann.write_text(json.dumps(_subset(None)))
    new_ann.write_text(json.dumps(_subset(NEW_CATEGORIES)))
    run = root / "run"
    ok(vtrain("train", *BASE, *_data_flags(demo_ann), "--output-dir", str(run), "--max-steps", "2",
              "--save-every", "2", "--log-every", "1"))
    return {"run": run, "ckpt": run / "checkpoints" / "step_2", "demo_ann": demo_ann, "new_ann": new_ann}


def _task(ann: Path, pretrained: Path, **model):
    from vtrain.config import build_config
    from vtrain.tasks.dino import DinoTask

    images = str(Path(_data_flags(ann)[3]))
    cfg = build_config("dino", overrides={
        "model": {"preset": "debug-resnet", "image_size": 128, "pretrained": str(pretrained), **model},
        "data": {"train_ann": str(ann), "train_images": images, "num_workers": 0}})
    return DinoTask(cfg)


@pytest.mark.parametrize("weights_of", ["dir", "file"])
def test_other_classes_keep_all_but_class_rows(sets, weights_of):
    """The checkpoint directory (or its model.safetensors, whose categories.json lies beside it) onto 5 classes of
    which 2 share a name with the checkpoint's 4: those rows are copied, the rest keep the recipe's initialisation."""
    from vtrain.engine.pretrained import resolve

    given = sets["ckpt"] if weights_of == "dir" else sets["ckpt"] / "model.safetensors"
    src = resolve(given)
    assert src.weights == sets["ckpt"] / "model.safetensors"
    assert [c["name"] for c in src.categories] == ["circle", "square", "triangle", "cross"]
    task = _task(sets["new_ann"], given)
    torch.manual_seed(0)
    model = task.build_model()
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    msg = task.load_pretrained(model, src.weights, src.categories)
    saved = load_file(str(src.weights))
    got = model.state_dict()

    keys = class_keys(list(got))
    assert len(keys) == 7  # 3 heads (2 decoder layers + the encoder proposals) x weight/bias + label_embed
    for k in got:
        if k not in keys:
            assert torch.equal(got[k], saved[k]), k
    # new labels follow the new ids: Square 0, hexagon 1, circle 2, star 3, blob 4; the demo's circle 0, square 1
    kept, new_rows = {0: 1, 2: 0}, [1, 3, 4]
    for k in keys:
        extra = 1 if k == "label_embed.weight" else 0
        assert got[k].shape[0] == 5 + extra and saved[k].shape[0] == 4 + extra, k
        for new, old in kept.items():
            assert torch.equal(got[k][new], saved[k][old]), k
        assert torch.equal(got[k][new_rows], fresh[k][new_rows]), k
        if k.endswith(".bias"):
            assert torch.allclose(got[k][new_rows], torch.full((3,), PRIOR_BIAS)), k
    assert not got["label_embed.weight"][5].any()  # the padding row stays zero
    assert ("class tensors (cls_heads.0-2.weight/bias, label_embed.weight) re-initialised for 4 → 5 classes, rows "
            "of 2 classes kept by name (Square, circle), 3 new") in msg, msg
    assert "\n" not in msg


def test_same_classes_load_as_is(sets):
    from vtrain.engine.pretrained import resolve

    src = resolve(sets["run"])  # a run directory: its newest checkpoint
    task = _task(sets["demo_ann"], sets["run"])
    model = task.build_model()
    msg = task.load_pretrained(model, src.weights, src.categories)
    saved = load_file(str(src.weights))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert "class tensors loaded as is (4 classes, same names)" in msg, msg


def test_a_folder_that_is_no_checkpoint_is_one_error(tmp_path):
    from vtrain.engine.pretrained import resolve
    from vtrain.errors import VtrainError

    with pytest.raises(VtrainError, match="--pretrained: .* is neither a complete checkpoint nor a run directory"):
        resolve(tmp_path)
    assert resolve(tmp_path / "w.safetensors").categories is None  # a bare file: no class names


@pytest.mark.parametrize("old,new,old_cats,new_cats,pairs,by_name", [
    (3, 3, None, None, [(0, 0), (1, 1), (2, 2)], False),  # a bare weights file, same count: the same classes
    (3, 4, None, ["a", "b", "c", "d"], [], False),  # a bare weights file, other count: nothing kept
    (3, 3, ["a", "b", "c"], ["c", "a", "b"], [(0, 2), (1, 0), (2, 1)], True),  # same names, other order
    (2, 2, ["Cat", " dog"], ["cat ", "DOG"], [(0, 0), (1, 1)], True),  # case and surrounding spaces ignored
    (2, 2, ["a", "b"], ["x", "y"], [], True),  # same count, no name in common: nothing kept
    (2, 1, [None, "b"], ["7"], [(0, 0)], True),  # a category without a name is named by its id (7)
])
def test_row_plan(old, new, old_cats, new_cats, pairs, by_name):
    def cats(names):
        return None if names is None else [{"id": 7 + i, **({} if n is None else {"name": n})}
                                           for i, n in enumerate(names)]

    plan = plan_rows(old, new, cats(old_cats), cats(new_cats))
    assert plan == RowPlan(old, new, pairs, by_name)
    assert plan.as_is == (old == new and pairs == [(i, i) for i in range(new)])


def test_finetune_run_on_other_classes(sets, tmp_path):
    """`vtrain train --pretrained CKPT` end to end: one log line, training runs, the new checkpoint has the new
    classes. A checkpoint whose other tensors do not fit (another --num-queries) is one error line."""
    run = tmp_path / "ft"
    proc = ok(vtrain("train", *BASE, *_data_flags(sets["new_ann"]), "--output-dir", str(run), "--max-steps", "2",
                     "--save-every", "2", "--log-every", "1", "--pretrained", str(sets["ckpt"])))
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "re-initialised for 4 → 5 classes" in x]
    assert len(lines) == 1 and "rows of 2 classes kept by name (Square, circle)" in lines[0], lines
    final = run / "checkpoints" / "step_2"
    assert json.loads((final / "categories.json").read_text()) == NEW_CATEGORIES
    assert load_file(str(final / "model.safetensors"))["cls_heads.0.weight"].shape[0] == 5

    proc = vtrain("train", *BASE, *_data_flags(sets["new_ann"]), "--output-dir", str(tmp_path / "bad"),
                  "--max-steps", "1", "--num-queries", "30", "--pretrained", str(sets["ckpt"]))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "another architecture" in errors[0] and "query_embed.weight (100, 64) vs (30, 64)" in errors[0], errors


def test_metric_model_of_other_identity_count_keeps_backbone(faces, tmp_path):
    """The face analogue: a full metric model of another identity count keeps backbone and neck, starts a fresh
    margin head, and says so; a tensor of another shape elsewhere is one error naming it."""
    from safetensors.torch import save_file

    from vtrain.config import build_config
    from vtrain.errors import VtrainError
    from vtrain.tasks.metric import MetricTask

    def task(path):
        return MetricTask(build_config("metric", overrides={"model": {"pretrained": str(path), "embedding_dim": 16},
                                                            "data": {"path": str(faces), "num_workers": 0}}))

    (tmp_path / "w.safetensors").touch()  # written below: the file is read when loading, not when building
    base = task(tmp_path / "w.safetensors")
    n = base.train_dataset().num_classes
    torch.manual_seed(0)
    src = base.build_model(n + 3)
    saved = {k: v.contiguous() for k, v in src.state_dict().items()}
    save_file(saved, str(tmp_path / "w.safetensors"))
    model = base.build_model()
    fresh_head = model.state_dict()["head.weight"].clone()
    msg = base.load_pretrained(model)
    assert f"head.weight re-initialised for {n + 3} → {n} identities" in msg, msg
    got = model.state_dict()
    assert torch.equal(got["head.weight"], fresh_head)
    assert all(torch.equal(v, saved[k]) for k, v in got.items() if not k.startswith("head."))

    neck = next(k for k in saved if k.startswith("neck.") and saved[k].dim() == 2)
    saved[neck] = torch.zeros(saved[neck].shape[0] + 1, saved[neck].shape[1])
    save_file(saved, str(tmp_path / "w.safetensors"))
    with pytest.raises(VtrainError, match=f"1 tensors of another shape \\({neck} "):
        base.load_pretrained(base.build_model())
