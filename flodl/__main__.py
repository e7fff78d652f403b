"""``python -m flodl <command>`` (also the ``flodl`` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(
            "usage: flodl init [DIR] [--package NAME]\n"
            "       flodl train [--config-dir DIR] [--config-name NAME] [-m] [KEY=VALUE ...]\n"
            "       flodl probe [cluster=NAME_OR_FILE] [cluster.KEY=VALUE ...] "
            "[--json] [--port PORT] [--data-path PATH]\n       flodl gpu-check\n"
            "(also python -m flodl ...; flodl train --help for train's flags)"
        )
        return 0 if args else 2
    if args[0] == "init":
        from flodl.cli.init import main as init

        return init(args[1:])
    if args[0] == "train":
        from flodl.cli.train import main as train

        return train(args[1:])
    if args[0] == "probe":
        from flodl.cli.probe import main as probe

        return probe(args[1:])
    if args[0] == "gpu-check":
        from flodl.cli.gpu_check import main as gpu_check

        return gpu_check(args[1:])
    print(
        f"error: unknown command {args[0]!r}; commands: init, train, probe, gpu-check",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
