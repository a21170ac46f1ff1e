"""The experiments' harness: the suites' registry (``suites``), the grid of merges (``grid``),
running it (``runner``, ``study``), training (``fitting``, ``trainer``), evaluation
(``evaluate``, ``passes``), ``allocations``, ``stats`` and the report (``report``,
``report_tables``, ``report_markdown``, ``report_figures``).

It never imports a model or a suite when it is imported (suites import the harness; the
registry imports a suite's module only when its spec is used). Submodules are imported
explicitly; nothing is imported here."""

__all__: list[str] = []  # nothing is re-exported: import the submodules
