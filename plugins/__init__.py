"""Built-in scheduling plugins, written only against the public plugin API (:mod:`epp.scheduling.runner`).

Installed as ``epp.plugins`` (the top-level ``plugins/`` folder is mapped there by pyproject).
They are registered the way third-party plugins are: through the ``epp.plugins`` entry-point group
declared in pyproject.toml (see :mod:`epp.scheduling.registry`).
"""
