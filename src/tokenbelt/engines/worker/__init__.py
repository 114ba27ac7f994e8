"""The batch engine in a worker process: the parent side (``WorkerEngine``), the child
process, and the pipe protocol between them (``_messages.py``: one typed record per
message kind)."""

from ._parent import ABORT_ENV, DEFAULT_STOP_GRACE, WorkerEngine
from ._supervision import HEARTBEAT_BOUND_S

__all__ = ["ABORT_ENV", "DEFAULT_STOP_GRACE", "HEARTBEAT_BOUND_S", "WorkerEngine"]
