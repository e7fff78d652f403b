"""How ranks agree on one set of weights: parameter averaging (compressed or not, collective or
through the controller), gradient all-reduce, outer optimizers, and the process group that
survives membership changes."""
