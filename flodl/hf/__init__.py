"""Hugging Face models, datasets and tokenizers as flodl components (``pip install 'flodl[hf]'``).

``model=hf`` (:mod:`.models`: ``AutoModelFor<Task>`` from a config or local weights, LoRA through
``peft``), ``dataset=hf`` (:mod:`.data`: ``datasets`` from local files, tokenized and packed
once), ``task=causal_lm`` / ``task=seq_classification`` (:mod:`.steps`) and the job's Hugging
Face outputs (:mod:`.export`). transformers, datasets and peft are imported inside the functions
that need them: ``import flodl`` never does. docs/guides/hugging-face.md is the user's page.
"""
