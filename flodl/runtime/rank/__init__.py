"""What a rank does: the process entry (``python -m flodl.runtime.rank``), the rank loop
(``loop.py``) and its parts (sync mode, step, memory plan, checkpoint state, calibration)."""
