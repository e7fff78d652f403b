"""flodl benchmarks (not timed tests): ``python -m bench.hetero``, ``bench.overhead``,
``bench.convergence``, then ``bench.render``. See bench/README.md (how to run) and
docs/benchmarks/index.md (the tables)."""
