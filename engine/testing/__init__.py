"""Synthetic test models: random-weight text models and vision towers with the real layouts, for tests,
benchmarks and ``python -m engine synth``; never on the product's load path."""
