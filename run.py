"""flodl's Hydra entry in this repository: compose -> validate -> launch -> report.

A thin example of the entry ``flodl train`` is (flodl/cli/train.py): a ``@hydra.main`` whose task
is :func:`flodl.cli.app.train`, run through :func:`flodl.cli.app.cli` for flodl's exit codes.
A project of one's own needs no such file: ``flodl train`` in its root reads ``./conf``.

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
