"""How ranks agree on one set of weights: parameter averaging (compressed or not, collective or
through the controller), gradient all-reduce, outer optimizers, optimizer state sharded across
ranks (each steps its pieces, then broadcasts them), and the process group that survives
membership changes."""
