"""How ranks come into being: one :class:`Cohort` protocol and its implementations (the launcher's
own process, local child processes, a warm fork server, ssh hosts, torchrun/srun, SLURM)."""
