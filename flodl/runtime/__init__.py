"""Process-per-rank runtime, one question per folder.

- ``cohorts/``: how ranks come into being (local children, the fork server, hosts, torchrun/srun,
  SLURM, the launcher's own process) and the control-plane server every such cohort composes.
- ``controller/``: what the controller decides (planning, dispatch, aggregation, membership,
  checkpoints, the bookkeeping of a run).
- ``rank/``: what a rank does (the process entry, the worker loop, pacing on the CPU rig); its
  ``env.py`` is the only reader of the rank role environment.
- ``sync/``: how ranks agree on weights (averaging, gradient sync, outer optimizers, groups).
- ``wire/``: how the launcher and the ranks talk (channel, links, messages, shared memory, stores).

``rank/``, ``sync/`` and ``wire/`` never import ``cohorts/`` or ``controller/``; ``wire/`` imports
nothing else of the runtime (``tests/unit/test_layering.py``).
"""
