"""Re-export of :mod:`edgebuild.speculative.config` for modules not yet moved to it.

Kept only for ``runtime/dspark_backend.py`` (being changed under issue 18); import
:mod:`edgebuild.speculative.config` instead.
"""

from edgebuild.speculative.config import (  # noqa: F401
    DEFAULT_DRAFT_TOP_K,
    PLANNED_METHODS,
    SUPPORTED_METHODS,
    SpeculativeConfig,
    default_draft_top_k,
)
