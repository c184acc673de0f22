"""The project's benchmarks, grouped by area (`kernels`, `engine`, `serving`, `compress`, `merge`,
`fidelity`, `gpu`), with what they share in `bench.common`.

    python -m bench list                 # every bench, with its docstring's first line
    python -m bench NAME [args...]       # run one (its ``main``), e.g. ``python -m bench plan``
    python -m bench.engine.plan [args]   # the same, by module

Results go to ``bench/results/<area>/``.
"""
