"""The studies above the training library: recipe comparisons and what they report.

``compare`` trains recipes x seeds and tabulates them (``compare_plot`` draws
its figures, ``compare_sweep`` joins comparisons that differ in one value),
``qwix_comparison`` runs the same paired comparison on a model fp8jax did not
define, ``stats`` is the one statistics module they all use (Student-t
intervals over seeds, the verdict on +-0.25%), ``stress`` measures how early
the monitors warn, ``plot_runs`` and ``telemetry_plot`` draw runs' metrics.

The library (formats through train, kernels, nn, models, parallel, data,
interop) never imports this package; it imports the library.  The package
imports nothing on its own.
"""
