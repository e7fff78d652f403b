"""How ranks agree on one set of weights: parameter averaging, gradient all-reduce, outer
optimizers, and the process group that survives membership changes."""
