"""The benchmark of benchmarks/results: `python benchmarks/bench.py ...` is
`python -m trimul.bench ...` (see trimul/bench.py)."""
from trimul.bench import main

if __name__ == "__main__":
    main()
