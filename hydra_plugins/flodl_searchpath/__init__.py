"""Hydra search-path plugin: flodl's config groups (``pkg://flodl.conf``) in every Hydra app.

Discovered through the ``hydra_plugins`` namespace package, so a project's own ``config.yaml``
can list ``elche: nccl_cadence``, ``cluster: cpu_rig``, ``logger: default`` ... in its defaults.
Appended, not prepended: a project's own ``conf/<group>/<name>.yaml`` wins over flodl's of the
same name. Thin: Hydra only, no flodl or torch import at discovery.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

#: Where flodl's groups live in an installed flodl (``flodl/conf/``, package data).
FLODL_CONF = "pkg://flodl.conf"


class FlodlSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if FLODL_CONF not in {element.path for element in search_path.get_path()}:
            search_path.append(provider="flodl", path=FLODL_CONF)
