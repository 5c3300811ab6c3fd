"""What drives a node from outside, never imported by the product (the CLI runs these lazily): a real
supervisor in a subprocess (node.py), client load (load.py), chaos/, the benchmarks (bench/), and
the readers they share: state.json (state_file.py), Prometheus text (prometheus.py), statistics."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: children run with it as cwd / on PYTHONPATH
