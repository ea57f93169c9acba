"""The ``ckptlib`` command line: ``ls``, ``inspect``, ``verify``, ``prune`` (see docs/cli.md),
one module per command, shared URL/step helpers in ``target``, formatting in ``output``.

Entry point: :func:`ckptlib.cli.main.main` (console script ``ckptlib``, or
``python -m ckptlib.cli.main``). This package does not import it eagerly, so that
``python -m ckptlib.cli.main`` runs the module exactly once.
"""
