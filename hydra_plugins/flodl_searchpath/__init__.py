"""Hydra search-path plugin: flodl's config groups (``pkg://flodl.conf``) in flodl's Hydra apps.

Discovered through the ``hydra_plugins`` namespace package, so a project's own ``config.yaml``
can list ``elche: nccl_cadence``, ``cluster: cpu_rig``, ``logger: default`` ... in its defaults.
Appended, not prepended: a project's own ``conf/<group>/<name>.yaml`` wins over flodl's of the
same name. Only in flodl's apps, those that imported its entry (``flodl.cli.app``: ``flodl
train``, ``run.py``, a project's own ``@hydra.main`` run through ``flodl.cli.app.cli``): another
Hydra app in the same environment keeps its own groups, without flodl's ``model``/``dataset``/...
options mixed in (the launcher plugin imports ``flodl.config`` at discovery in every app, so
``flodl`` itself being imported says nothing). Thin: Hydra only, no flodl or torch import.
"""

import sys

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

#: Where flodl's groups live in an installed flodl (the repository's ``conf/``, package data).
FLODL_CONF = "pkg://flodl.conf"


class FlodlSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if "flodl.cli.app" not in sys.modules:  # not a flodl app: leave its search path alone
            return
        if FLODL_CONF not in {element.path for element in search_path.get_path()}:
            search_path.append(provider="flodl", path=FLODL_CONF)
