# Benchmark and demo targets (owned by the bench crate). Included from the top-level Makefile.
#   make run    the demo: kvroute vs round robin on an embedded small fleet (1-2 minutes);
#               `make run PRECISE=1`: kvroute in precise mode (its own kvroute-indexer) vs kvroute;
#               `make run EPP=1`: kvroute as kvroute-epp behind plain Envoy vs round robin
#   make bench  the llm-d-shaped comparison across every router, prints the table
#               (results.json, results.md, ttft.svg in $(BENCH_OUT))
#   make bench-overhead  CPU and latency kvroute adds (as the filter and as kvroute-epp), next to
#               plain Envoy, the floor filter, smg and vllm-router (kvroute-overhead cpu; the
#               rows in $(BENCH_OUT)/overhead.json)
#   make bench-instructions  instructions per request of plain Envoy, the floor filter and
#               kvroute, each Envoy under valgrind's callgrind (counts that ignore the machine's load)
#   make bench-placement  the placement issue's three lines, each run PLACEMENT_REPEAT times with
#               the next seeds (compare --repeat): Zipf and grouped under cache pressure, llm-d
#   make bench-precise  precise mode's lines, each PRECISE_REPEAT times (compare --repeat, default
#               3) into bench/results/precise/<line>/, then the table of their targets, met or
#               missed (summary.md there, and README.md's and bench/README.md's precise blocks);
#               `make bench-precise PRECISE_LINES=zipf-pressure` runs one line; commit what it writes
#   make bench-results  the README's tables: each workload of RESULTS_SETS through its routers,
#               one run each, into bench/results/<workload>/ (results.json, results.md, ttft.svg,
#               stamped with the build's commit and the run's date); commit what it writes
#   make lab    routers against the simulator's engine core in virtual time (kvroute-bench lab):
#               LAB_WORKLOAD on LAB_FLEET through LAB_ROUTERS over LAB_SEEDS paired seeds, paired
#               against LAB_BASELINE, into bench/results/lab/<workload>/ (minutes, deterministic)
#   make lab-precise  precise mode's lines decided in the lab (LAB_SEEDS paired seeds each) into
#               bench/results/lab/precise/<line>/, and the table of their targets (README.md's and
#               bench/README.md's lab-precise blocks); commit what it writes
#   make lab-calibrate  the lab beside the wall-clock bench: for each results.json under
#               bench/results, the lab on the same fleet and workload from the same seed
#               (bench/results/lab/calibration/summary.md); commit what it writes
#   make peers  installs the peer routers (smg, vllm-router), each in its own venv
#   make real   the comparison on real vLLM engines (CPU, a tiny model) instead of the sim:
#               round robin, kvroute, smg, kvroute@3, smg@3 (results in $(REAL_OUT))

.PHONY: lab lab-precise lab-calibrate
.PHONY: run bench peers bench-all bench-overhead bench-instructions bench-placement bench-precise bench-precise-summary bench-results bench-summary real

BENCH := target/release/kvroute-bench
OVERHEAD := target/release/kvroute-overhead
PEERS := .work/peers
BENCH_OUT ?= .work/bench
BENCH_FLEET ?= bench/fleets/default.json
BENCH_WORKLOAD ?= bench/workloads/llm-d.json
# NAME@N: N instances of NAME behind one round-robin Envoy (scale-out, each with its own state).
# kvroute-precise: kvroute with its own kvroute-indexer on the engines' KV events (precise mode).
# kvroute-epp (not in the default list): an Envoy asking kvroute-epp over ext_proc; the targets
# that may run it build it (`epp`).
BENCH_ROUTERS ?= round_robin,least_request,ring_hash,kvroute,kvroute@3,kvroute:prefix_hash,kvroute-precise,kvroute-precise@3,smg,smg@3,vllm-router:cache_aware,vllm-router:consistent_hash,vllm-router:kv_aware,oracle
# Each peer: venv name and the PyPI requirement installed into it.
PEER_PKGS := smg=smg vllm-router=vllm-router

# Where kvroute-bench finds the peers' venvs.
export KVROUTE_PEERS := $(abspath $(PEERS))

REAL_OUT ?= .work/real
REAL_ROUTERS ?= round_robin,kvroute,smg,kvroute@3,smg@3

run: deps build $(if $(EPP),epp)
	$(BENCH) demo $(if $(PRECISE),--precise) $(if $(EPP),--epp)

bench: deps build epp peers
	$(BENCH) compare --fleet $(BENCH_FLEET) --workload $(BENCH_WORKLOAD) --routers $(BENCH_ROUTERS) --out $(BENCH_OUT)

# Three vLLM engines (bench/fleets/real.json: 48 KV blocks of 128 tokens each) started once, every
# router's run from emptied caches; the workload (bench/workloads/real.json) is sized to what two
# cores running three engines serve. `make vllm` (Makefile) installs vLLM and builds the model.
real: deps build epp peers vllm
	$(BENCH) compare --fleet bench/fleets/real.json --workload bench/workloads/real.json --routers $(REAL_ROUTERS) --out $(REAL_OUT)

bench-overhead: deps build epp peers
	@mkdir -p $(BENCH_OUT)
	$(OVERHEAD) cpu --json $(BENCH_OUT)/overhead.json

bench-instructions: deps build
	command -v valgrind >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind; }
	$(OVERHEAD) instructions

# Every default workload in turn (takes much longer than `make bench`).
bench-all: deps build epp peers
	@for w in bench/workloads/*.json; do \
	  n=$$(basename $$w .json); \
	  $(BENCH) compare --fleet $(BENCH_FLEET) --workload $$w --routers $(BENCH_ROUTERS) --out $(BENCH_OUT)/$$n || exit 1; \
	done

# Zipf-skewed groups against smg and the oracle, three gateways against one, llm-d against the
# oracle: each line PLACEMENT_REPEAT times (repeats.md in each directory says how often it held).
PLACEMENT_REPEAT ?= 3

bench-placement: deps build peers
	$(BENCH) compare --fleet bench/fleets/pressure.json --workload bench/workloads/zipf-pressure.json --routers kvroute,smg,oracle --repeat $(PLACEMENT_REPEAT) --out $(BENCH_OUT)/placement-zipf
	$(BENCH) compare --fleet bench/fleets/pressure.json --workload bench/workloads/grouped-pressure.json --routers kvroute,kvroute@3 --repeat $(PLACEMENT_REPEAT) --out $(BENCH_OUT)/placement-grouped
	$(BENCH) compare --fleet $(BENCH_FLEET) --workload bench/workloads/llm-d.json --routers kvroute,oracle --repeat $(PLACEMENT_REPEAT) --out $(BENCH_OUT)/placement-llm-d

# Precise mode's lines: kvroute-precise first (repeats.md pairs it with each other router), a
# workload on a fleet (agentic-pressure: agentic on the pressure fleet). Their targets are in
# bench/targets/precise.toml; `precise-summary` refuses a line whose repeats.json is not its
# workload, fleet and routers. PRECISE_REPEAT must be at least 2 (one run writes no repeats.json).
PRECISE_DIR := bench/results/precise
PRECISE_ALL := zipf-pressure grouped-pressure llm-d llm-d-sglang agentic tenants agentic-pressure
PRECISE_LINES ?= $(PRECISE_ALL)
PRECISE_REPEAT ?= 3
PRECISE_WORKLOAD.agentic-pressure := agentic
PRECISE_WORKLOAD.llm-d-sglang := llm-d
PRECISE_FLEET.zipf-pressure := pressure
PRECISE_FLEET.grouped-pressure := pressure
PRECISE_FLEET.agentic-pressure := pressure
PRECISE_FLEET.llm-d-sglang := sglang
PRECISE_ROUTERS := kvroute-precise,kvroute
PRECISE_ROUTERS.zipf-pressure := kvroute-precise,smg
PRECISE_ROUTERS.grouped-pressure := kvroute-precise,kvroute-precise@3,kvroute-precise@8
PRECISE_ROUTERS.agentic-pressure := kvroute-precise,oracle,smg

bench-precise: deps build peers
	@set -e; $(foreach l,$(PRECISE_LINES),\
	  echo "bench-precise: $(l)"; \
	  $(BENCH) compare --fleet bench/fleets/$(or $(PRECISE_FLEET.$(l)),default).json \
	    --workload bench/workloads/$(or $(PRECISE_WORKLOAD.$(l)),$(l)).json \
	    --routers $(or $(PRECISE_ROUTERS.$(l)),$(PRECISE_ROUTERS)) \
	    --repeat $(PRECISE_REPEAT) --out $(PRECISE_DIR)/$(l);)
	$(MAKE) --no-print-directory bench-precise-summary

# The precise lines' table from every line present (bench/results/precise/summary.md, and the
# precise blocks of README.md and bench/README.md); lines not run show as not measured.
bench-precise-summary: bins
	$(BENCH) precise-summary --results $(PRECISE_DIR) --readme README.md --readme bench/README.md

# The generated results the READMEs quote: one set per workload, for the build checked out.
# `make bench-results RESULTS_SETS=llm-d` regenerates one. Each set: its fleet and its routers.
RESULTS_DIR := bench/results
RESULTS_ALL := llm-d zipf-pressure grouped-pressure agentic multimodal tenants
RESULTS_SETS ?= $(RESULTS_ALL)
RESULTS_SCALE := round_robin,kvroute,kvroute@3,kvroute-precise,smg,smg@3,oracle
RESULTS_SHAPES := round_robin,kvroute,kvroute-precise,smg,oracle
RESULTS_FLEET.llm-d := default
RESULTS_FLEET.zipf-pressure := pressure
RESULTS_FLEET.grouped-pressure := pressure
RESULTS_ROUTERS.llm-d := $(RESULTS_SCALE)
RESULTS_ROUTERS.zipf-pressure := $(RESULTS_SCALE)
RESULTS_ROUTERS.grouped-pressure := $(RESULTS_SCALE)

bench-results: deps build epp peers
	@set -e; $(foreach s,$(RESULTS_SETS),\
	  echo "bench-results: $(s)"; \
	  $(BENCH) compare --fleet bench/fleets/$(or $(RESULTS_FLEET.$(s)),default).json \
	    --workload bench/workloads/$(s).json --routers $(or $(RESULTS_ROUTERS.$(s)),$(RESULTS_SHAPES)) \
	    --out $(RESULTS_DIR)/$(s);)
	$(MAKE) --no-print-directory bench-summary

# README's results table from every set present (bench/results/summary.md, and README.md's block).
bench-summary: bins
	@ws=""; for s in $(RESULTS_ALL); do [ -f $(RESULTS_DIR)/$$s/results.json ] && ws="$$ws,$$s"; done; \
	  $(BENCH) summary --results $(RESULTS_DIR) --workloads $${ws#,} --readme README.md

# A peer that fails to install is left without its marker; `compare` then reports it as skipped.
peers:
	@mkdir -p $(PEERS)
	@for p in $(PEER_PKGS); do \
	  name=$${p%%=*}; req=$${p#*=}; dir=$(PEERS)/$$name; \
	  if [ -f $$dir/.installed ]; then continue; fi; \
	  echo "peers: installing $$req into $$dir"; \
	  ( $(PYTHON) -m venv $$dir && \
	    $$dir/bin/pip install --quiet --disable-pip-version-check $$req && \
	    touch $$dir/.installed ) > $(PEERS)/$$name.log 2>&1 \
	    || echo "peers: $$name failed to install (see $(PEERS)/$$name.log); it will be reported as skipped"; \
	done

# The lab: deterministic, in virtual time, no Envoy or sockets (bench/README.md, "The lab").
LAB_DIR := bench/results/lab
LAB_FLEET ?= bench/fleets/pressure.json
LAB_WORKLOAD ?= bench/workloads/zipf-pressure.json
LAB_ROUTERS ?= round_robin,least_request,kvroute,kvroute@3,kvroute-precise,smg,smg@3,oracle
LAB_BASELINE ?= smg
LAB_SEEDS ?= 30

lab: bins
	$(BENCH) lab --fleet $(LAB_FLEET) --workload $(LAB_WORKLOAD) --routers $(LAB_ROUTERS) \
	  --seeds $(LAB_SEEDS) --baseline $(LAB_BASELINE) --out $(LAB_DIR)/$(basename $(notdir $(LAB_WORKLOAD)))

lab-precise: bins
	$(BENCH) lab-precise --results $(LAB_DIR)/precise --seeds $(LAB_SEEDS) --readme README.md --readme bench/README.md

# Five lab seeds from each file's own: the lab's mean over the replicas' port draws (kvroute
# places groups by hashing addresses), against one wall-clock run.
LAB_CALIBRATE_SEEDS ?= 5

lab-calibrate: bins
	$(BENCH) lab-calibrate --results $(RESULTS_DIR) --seeds $(LAB_CALIBRATE_SEEDS)
