"""What a rank does: the process entry (``python -m flodl.runtime.rank``), the worker loop, pacing
on the CPU rig, the rank role environment (read only in ``env.py``)."""
