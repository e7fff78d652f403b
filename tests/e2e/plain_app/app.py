"""A Hydra app that is not a flodl job, configured to use the flodl launcher by mistake."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    print(f"plain app ran with x={cfg.x}")


if __name__ == "__main__":
    main()
