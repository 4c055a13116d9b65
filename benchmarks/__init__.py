"""The dtype-policies benchmarks in a source checkout: `python -m benchmarks --help`.

One home: the suite lives in `dtype_policies.bench`, inside the package, so
that `dtype-policies bench` runs it from an install: its workloads
(`bench.workloads`, one `register(...)` line each, a new file drops in), the
real trained models against the peers (`bench.realmodels`), the one timer
(`bench.harness`) and the report. This folder holds what an install does not
need: `python -m benchmarks` (that suite, writing to `benchmarks/results/`,
not committed), `python -m benchmarks quality ...` (the quick real-model
quality table), `install_llamacpp.sh` (the llama.cpp peer, built for this
CPU), and research tools that time through the same harness and are not part
of the suite's tables: `kernels_research`, `accuracy_research`,
`advisor_demo`, `profile_llm`, and `saving` (one save or load per fresh
process, whose single duration is the figure).
"""
