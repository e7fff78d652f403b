"""Schema of ``hydra/launcher=flodl``; registered in Hydra's ConfigStore at discovery."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class FlodlLauncherConf:
    _target_: str = "hydra_plugins.flodl_launcher.launcher.FlodlLauncher"
    report: bool = True  # write ab_report.{md,json,png} when a sweep has several jobs


ConfigStore.instance().store(group="hydra/launcher", name="flodl", node=FlodlLauncherConf)
