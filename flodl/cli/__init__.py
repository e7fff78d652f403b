"""The command line: ``flodl train`` (``train``: a project's own config with flodl's groups), the
Hydra job (``app``), sweeps, ``probe`` and ``gpu-check``."""
