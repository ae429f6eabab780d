# Two commands do all the set-up on a fresh machine:
#   make demo   install into .venv and generate text with the shipped demo model
#   make test   install into .venv (with the test extra) and run lint + the test suite
# TORCH selects the PyTorch build: the default pin takes a CPU wheel; on Jetson / CUDA desktops
# see README.md (e.g. `make demo TORCH=` to keep a torch that is already installed).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PROMPT ?= In the beginning
BIN := $(VENV)/bin

.PHONY: demo test install install-test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e .

install-test: $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[test,serve]"

demo: install
	$(BIN)/edgerun generate --max-tokens 80 --temperature 0.8 --top-p 0.95 --seed 1 "$(PROMPT)"

lint: install-test
	$(BIN)/ruff check edgerun kernels tests benchmarks scripts
	$(BIN)/ruff format --check edgerun kernels tests benchmarks scripts

test: install-test lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
