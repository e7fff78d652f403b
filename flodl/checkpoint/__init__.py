"""Checkpoints: bundles (``bundle``), the shards ranks write (``shards``), what a run leaves
(``results``: ``TrainedState``, ``model.pt``)."""
