"""patchkv's benchmark suite: `python -m evals` (see evals/__main__.py), its configurations (suite.py) and tasks
(tasks.py); the throughput and profiling benchmarks (bench_throughput.py, profile_paths.py); kvpress beside us in
its own environment (peers/)."""
