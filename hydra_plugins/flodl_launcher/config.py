"""Schema of ``hydra/launcher=flodl`` and the base of every group composed from the schema
(``elche/_schema``, ``cluster/_schema``, ...: flodl/config/groups.py), registered in Hydra's
ConfigStore at discovery (pydantic only: no torch)."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from flodl.config.groups import SCHEMA_GROUPS, schema_node, subsection_nodes


@dataclass
class FlodlLauncherConf:
    _target_: str = "hydra_plugins.flodl_launcher.launcher.FlodlLauncher"
    report: bool = True  # write ab_report.{md,json,png} when a sweep has several jobs


ConfigStore.instance().store(group="hydra/launcher", name="flodl", node=FlodlLauncherConf)
# Every key of a section at its schema default: conf/<group>/<option>.yaml extends it with its
# changes, so every key is settable from the command line without `+`.
for _group in SCHEMA_GROUPS:
    ConfigStore.instance().store(group=_group, name="_schema", node=schema_node(_group))
for (_group, _name), _node in subsection_nodes().items():  # logger/_wandb, logger/_mlflow
    ConfigStore.instance().store(group=_group, name=_name, node=_node)
