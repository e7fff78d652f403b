"""Models, datasets and train steps that ``conf/`` points at (components live in ``flodl/``).

Everything here is a plain ``nn.Module`` or function: no ``torch.distributed``, no rank logic.
The runner decides where and how often a step runs; a recipe only says what one step is.
"""
