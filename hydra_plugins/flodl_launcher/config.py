"""Schema of ``hydra/launcher=flodl`` and the ElChe presets' base, registered in Hydra's
ConfigStore at discovery (pydantic only: no torch)."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from flodl.config import elche_schema_node


@dataclass
class FlodlLauncherConf:
    _target_: str = "hydra_plugins.flodl_launcher.launcher.FlodlLauncher"
    report: bool = True  # write ab_report.{md,json,png} when a sweep has several jobs


ConfigStore.instance().store(group="hydra/launcher", name="flodl", node=FlodlLauncherConf)
# Every ElChe key at ElCheConfig's default: conf/elche/<mode>.yaml extends it with its changes.
ConfigStore.instance().store(group="elche", name="_schema", node=elche_schema_node())
