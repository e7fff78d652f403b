"""Where ranks go: the visible GPUs (``gpus``, no torch import), the topology a run gets, cluster
files written in Python (``cluster``), and reaching worker hosts over ssh (``remote``)."""
