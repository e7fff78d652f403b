"""A project of one's own trained by flodl: its model, data and train step (nothing of flodl's).

From this directory: ``flodl train`` (conf/config.yaml), ``flodl train -m elche=cpu_sync,
cpu_cadence`` (a two-mode sweep with its A/B report), ``python train_api.py`` (the Python API).
"""
