"""Built-in experiments: a small pretrained encoder to train task LoRAs on and merge them.

Submodules are imported explicitly (``from netutility_jax.experiments import minilm``); nothing
heavy is imported here.
"""
