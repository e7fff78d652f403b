"""flodl's Hydra entry: compose -> validate -> launch -> report.

python run.py                                   # the default job (see conf/config.yaml)
python run.py model=lenet elche=cpu_async       # swap any component by config
python run.py -m elche=nccl_sync,nccl_cadence   # A/B sweep; ends with ab_report.md
"""

import hydra
from omegaconf import DictConfig

from flodl.cli.app import cli, train


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return train(cfg)


if __name__ == "__main__":
    cli(main)
