"""flodl's Hydra config groups (``pkg://flodl.conf``: the ``flodl_searchpath`` plugin adds them to
every Hydra app's search path) and its own default primary config, ``config.yaml``."""
