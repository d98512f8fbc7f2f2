# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vtrain-installed
# The torch/torchvision pair this project is built and tested with (the CPU build machines serve exactly this pair).
TORCH_PAIR ?= torch==2.14.1 torchvision==0.29.1

# The demo's detection recipe; benchmarks/demo_seeds.py reads it from here and runs it for several seeds
# (README: the AP range over seeds; docs/determinism.md §4). --deterministic --threads 2 below make a run repeatable
# on one machine whatever OMP_NUM_THREADS says (2 intra-op threads: the 2-core machines this demo is timed on).
# --num-workers 0: the samples are read in the training process; a loader worker would take CPU from the two compute
# threads on those 2 cores (and start a worker server first), and each sample is seeded by (seed, epoch, index)
# either way, so the weights are bit for bit those of a run with workers (docs/determinism.md §4).
DEMO_DINO_FLAGS := --task dino --model demo-resnet --data demo --image-size 192 --batch-size 8 --max-steps 840 \
	--dn-queries 100 --lr 1e-3 --warmup-steps 50 --ema-decay 0.99 --backbone-lr-mult 1 --clip-grad 1.0 \
	--mixed-precision no --num-workers 0 --log-every 40 --eval-every 420 --save-every 420 --keep-last 1

.PHONY: demo test test-fast fuzz install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PAIR)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# `make demo` in five stages, each announced by a banner; the step counts are read from the commands' own flags.
DEMO_FACE_STEPS := 300
DEMO_DINO_STEPS := $(shell echo '$(DEMO_DINO_FLAGS)' | sed -n 's/.*--max-steps \([0-9]*\).*/\1/p')
# where `--data demo` keeps the detection set (docs/detection.md): its held-out images are what stage 5 draws
DEMO_SHAPES = $$($(PY) -c "from vtrain.data.demo import data_root; print(data_root('dino', 'demo'))")

demo: $(STAMP)
	@echo "[1/5] face recognition: training the debug ViT with a CosFace head on the demo identities, $(DEMO_FACE_STEPS) steps (CPU, a few minutes) ..."
	rm -rf runs/demo
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/vtrain train --task metric --model debug --data demo \
		--output-dir runs/demo --max-steps $(DEMO_FACE_STEPS) --batch-size 64 --head cosface --scale 32 --lr 3e-3 \
		--head-parallel sharded --sample-rate 0.5 \
		--weight-decay 0.05 --warmup-steps 20 --mixed-precision bf16 \
		--log-every 25 --eval-every 150 --save-every 150 --keep-last 2
	@echo "[2/5] face recognition: vtrain eval of the last checkpoint (held-out identities and heldout.bin) ..."
	$(VENV)/bin/vtrain eval --checkpoint runs/demo --data demo
	@echo "[3/5] detection: training DINO (demo-resnet) from scratch on the demo shapes, $(DEMO_DINO_STEPS) steps (CPU, several minutes) ..."
	rm -rf runs/demo-dino
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/vtrain train $(DEMO_DINO_FLAGS) --output-dir runs/demo-dino \
		--deterministic --threads 2
	@echo "[4/5] detection: vtrain eval, COCO box AP on the held-out images ..."
	$(VENV)/bin/vtrain eval --task dino --checkpoint runs/demo-dino --save-predictions runs/demo-dino/predictions.json
	@echo "[5/5] detection: vtrain predict draws its boxes on 4 held-out images ..."
	shapes=$(DEMO_SHAPES) && $(VENV)/bin/vtrain predict --checkpoint runs/demo-dino --out runs/demo-dino/predicted \
		--images "$$shapes/val2017/00000[0-3].jpg" --ann "$$shapes/annotations/instances_val2017.json" --num-workers 0 \
		--score-threshold 0.2 --nms-iou 0.5
	@echo "demo done: face runs/demo (train.log, eval.log), detection runs/demo-dino (train.log, eval.log); the drawn detections are in runs/demo-dino/predicted/"

# Two pytest-xdist workers (TEST_WORKERS=N for more): one of them runs the multi-process tests one after another
# (tests/conftest.py groups them), the other the single-process ones meanwhile (docs/testing.md "Two workers").
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout 900 -n $(TEST_WORKERS) --dist loadgroup tests

# The unit lane: everything but whole CLI runs and multi-process runs (docs/testing.md).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout 900 -m "not slow and not integration" tests

# The fuzz lane alone with many more generated examples than `make test` runs (random, failures kept in .hypothesis/
# and replayed first); VTRAIN_FUZZ_EXAMPLES=N sets the number per property (docs/testing.md).
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 VTRAIN_FUZZ=1 $(PY) -m pytest -q --timeout 3600 -m fuzz tests

clean:
	rm -rf runs .pytest_cache .hypothesis
