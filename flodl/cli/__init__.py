"""The command line: the Hydra job (``app``), sweeps, ``probe`` and ``gpu-check``."""
