"""``flodl train [overrides]``: run the user's own project, composed with flodl's config groups.

flodl train                                   # ./conf/config.yaml (else flodl's default job)
flodl train trainer.num_epochs=3 cluster=solo # any knob, any of flodl's groups
flodl train -m elche=nccl_sync,nccl_cadence   # a sweep; ends with ab_report.md
flodl train --config-dir path/to/conf --config-name other

The project's config directory (``--config-dir``; default ``./conf`` where it exists, else flodl's
own default job, ``conf/config.yaml``) is Hydra's primary config path; flodl's groups
(``elche``, ``cluster``, ``logger``, ...) come from the ``flodl_searchpath`` plugin. Every run,
single or sweep, goes through the flodl launcher in Hydra's MULTIRUN mode, set here, so the
project's files need no ``hydra: {mode: MULTIRUN}``. The working directory goes first on
``sys.path``, so the project's modules import as they would under ``python train.py``.
Exit codes: 0 ok, 1 a job failed, 2 a refused config, 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

#: flodl's own default primary config (``conf/config.yaml``) as Hydra addresses it.
PACKAGED_CONFIG = "pkg://flodl.conf"

USAGE = (
    "usage: flodl train [--config-dir DIR] [--config-name NAME] [-m] [KEY=VALUE ...]\n"
    "  --config-dir, -cd  the project's config directory (default: ./conf if it exists, else\n"
    "                     flodl's default job); flodl's groups (elche, cluster, logger, ...)\n"
    "                     are found from any project\n"
    "  --config-name, -cn the primary config in it (default: config, i.e. config.yaml)\n"
    "  -m, --multirun     a sweep over comma-separated values (single runs need no flag)\n"
    "  Hydra's own flags (--cfg job, --info, --hydra-help) work as with any Hydra app."
)


def split_args(argv: list[str]) -> tuple[str | None, str, list[str]]:
    """``--config-dir`` and ``--config-name`` (any of Hydra's spellings) taken out of ``argv``."""
    config_dir: str | None = None
    config_name = "config"
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in ("--config-dir", "-cd", "--config-name", "-cn"):
            if not eq:
                value = next(it, "")
            if not value:
                raise ValueError(f"{flag}: needs a value")
            if flag in ("--config-dir", "-cd"):
                config_dir = value
            else:
                config_name = value
        elif flag in ("--config-path", "-cp"):
            raise ValueError(f"{flag}: use --config-dir DIR (a directory, relative to here)")
        else:
            rest.append(arg)
    return config_dir, config_name, rest


def resolve_config_dir(config_dir: str | None, config_name: str, cwd: Path) -> str:
    """Hydra's primary config path, or ValueError with the one line to print."""
    if config_dir is None:
        default = cwd / "conf"
        if not default.is_dir():
            return PACKAGED_CONFIG
        path = default
    else:
        path = (cwd / config_dir).resolve()
        if not path.is_dir():
            raise ValueError(
                f"--config-dir={config_dir}: no such directory ({path}); give the directory "
                "that holds your config.yaml"
            )
    name = config_name.removesuffix(".yaml")
    if not (path / f"{name}.yaml").is_file():
        have = sorted(p.stem for p in path.glob("*.yaml"))
        raise ValueError(
            f"--config-name={config_name}: no {path / (name + '.yaml')} (have: "
            f"{', '.join(have) or 'no .yaml file'}); pass --config-name NAME or add it"
        )
    return str(path)


#: Hydra's flags that choose what it does instead of running (or --run: a single RUN-mode job).
_MODE_FLAGS = ("-r", "--run", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")


def hydra_argv(rest: list[str]) -> list[str]:
    """What Hydra parses: always MULTIRUN, the flodl launcher unless the command names one."""
    args = list(rest)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    if not flags & {"-m", "--multirun", *_MODE_FLAGS}:  # Hydra takes one mode flag
        args.insert(0, "--multirun")
    if not any(a.lstrip("+~").startswith("hydra/launcher=") for a in args):
        args.append("hydra/launcher=flodl")
    return args


def _task(cfg: Any) -> Any:
    """The job under any other launcher (the flodl launcher runs :func:`flodl.cli.app.train`
    itself, with the job it validated)."""
    from flodl.cli.app import train

    return train(cfg)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from flodl.cli.app import say_error

    cwd = Path.cwd()
    try:
        config_dir, config_name, rest = split_args(argv)
        config_path = resolve_config_dir(config_dir, config_name, cwd)
    except ValueError as exc:
        say_error(str(exc))
        return 2
    # The project's own modules (model: {_target_: mypkg.models.Net}) import as under
    # `python train.py` run from the project's root; ranks inherit sys.path.
    if str(cwd) not in sys.path and "" not in sys.path[:1]:
        sys.path.insert(0, str(cwd))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(cwd), os.environ.get("PYTHONPATH", "")] if p
    )

    import hydra

    from flodl.cli.app import cli

    entry = hydra.main(
        version_base="1.3", config_path=config_path, config_name=config_name.removesuffix(".yaml")
    )(_task)
    sys.argv = ["flodl train", *hydra_argv(rest)]
    cli(entry)
    return 0
