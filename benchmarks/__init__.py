"""The dtype-policies benchmarks in a source checkout: `python -m benchmarks --help`.

The suite lives in `dtype_policies.bench` (so that `dtype-policies bench`
works from an install): its workloads (`bench.workloads`, one `register(...)`
line each, a new file drops in), the real trained models
(`bench.realmodels`), the one timer (`bench.harness`) and the report.
`python -m benchmarks` runs that suite and writes to `benchmarks/results/`
(not committed); `python -m benchmarks quality ...` is the quick real-model
quality table. The research scripts beside this file
(`kernels_research`, `accuracy_research`, `advisor_demo`, `profile_llm`,
`saving`) time through the same harness.
"""
