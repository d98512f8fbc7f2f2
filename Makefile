# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vtrain-installed
# The torch/torchvision pair this project is built and tested with (the CPU build machines serve exactly this pair).
TORCH_PAIR ?= torch==2.14.1 torchvision==0.29.1

# The demo's detection recipe; benchmarks/demo_seeds.py reads it from here and runs it for several seeds
# (README: the AP range over seeds; docs/determinism.md §4). --deterministic --threads 1 below make a run repeatable
# on one machine whatever OMP_NUM_THREADS says.
DEMO_DINO_FLAGS := --task dino --model demo-resnet --data demo --image-size 192 --batch-size 8 --max-steps 950 \
	--lr 1e-3 --warmup-steps 50 --ema-decay 0.99 --backbone-lr-mult 1 --clip-grad 1.0 --mixed-precision no --num-workers 1 \
	--log-every 50 --eval-every 500 --save-every 500 --keep-last 1

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PAIR)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/vtrain train --task metric --model debug --data demo \
		--output-dir runs/demo --max-steps 300 --batch-size 64 --head cosface --scale 32 --lr 3e-3 \
		--head-parallel sharded --sample-rate 0.5 \
		--weight-decay 0.05 --warmup-steps 20 --mixed-precision bf16 \
		--log-every 25 --eval-every 150 --save-every 150 --keep-last 2
	$(VENV)/bin/vtrain eval --checkpoint runs/demo --data demo
	rm -rf runs/demo-dino
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/vtrain train $(DEMO_DINO_FLAGS) --output-dir runs/demo-dino \
		--deterministic --threads 1
	$(VENV)/bin/vtrain eval --task dino --checkpoint runs/demo-dino --save-predictions runs/demo-dino/predictions.json

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout 900 tests

# The unit lane: everything but whole CLI runs and multi-process runs (docs/testing.md).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout 900 -m "not slow and not integration" tests

clean:
	rm -rf runs .pytest_cache
