"""Built-in scheduling plugins, by kind (filter/, scorer/, picker/, profile/, producer/).

Written only against the public plugin API, :mod:`epp.framework` (a contract CI checks), exactly as a
third-party plugin is. Installed as ``epp.plugins`` (the top-level ``plugins/`` folder is mapped
there by pyproject) and registered the way third-party plugins are: through the ``epp.plugins``
entry-point group declared in pyproject.toml (see :mod:`epp.scheduling.registry`).
"""
