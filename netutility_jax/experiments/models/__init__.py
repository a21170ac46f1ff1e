"""The experiments' models: MiniLM (``minilm``), the Llama family (``llama``, read from GGUF by
``gguf_io`` or from a Hugging Face folder) and CLIP (``clip``), with their loaders and
tokenizers. Submodules are imported explicitly; nothing is imported here."""

__all__: list[str] = []  # nothing is re-exported: import the submodules
