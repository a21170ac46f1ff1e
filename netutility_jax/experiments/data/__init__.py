"""The experiments' data: the built-in text tasks and CSV tasks (``tasks``, with
``task_sources`` and ``rdata_reader``), tasks as prompts (``lang_tasks``), the NLI datasets
(``nli_data``) and the image datasets (``vision_data``). Submodules are imported explicitly;
nothing is imported here."""

__all__: list[str] = []  # nothing is re-exported: import the submodules
