"""The ``ckptlib`` command line (see docs/cli.md): one module per command, shared URL/step helpers
in ``target``, formatting in ``output``. Entry point: :func:`ckptlib.cli.main.main`, not imported
eagerly here so that ``python -m ckptlib.cli.main`` runs the module exactly once.
"""
