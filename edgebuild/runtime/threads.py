"""torch's intra-op threads around the CPU runtime's small torch ops: :mod:`edgebuild.ops.threads`
(the kernels' wrappers in :mod:`edgebuild.ops` use them too)."""

from edgebuild.ops.threads import converted, one_thread

__all__ = ["converted", "one_thread"]
