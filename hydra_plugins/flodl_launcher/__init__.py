"""Hydra launcher plugin ``hydra/launcher=flodl`` (discovered through the hydra_plugins namespace).

Thin and lazy: nothing heavy is imported at discovery; the work lives in ``flodl.cli.sweep``.
"""
