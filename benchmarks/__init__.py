"""mxmoe's benchmark suites: ``python -m benchmarks SUITE... [--quick] [--out-dir DIR]`` (see ``__main__``),
each writing ``benchmarks/results/<gpu>/<suite>.json``; ``python -m benchmarks report`` renders RESULTS.md."""
