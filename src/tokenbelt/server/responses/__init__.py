"""The Responses dialect (``/v1/responses``): a response made like any other request,
stateless unless the server keeps a bounded store; any response in flight can be
cancelled by id (``_routes``, ``_turn``, ``_items``, ``_store``)."""

from ._routes import router
from ._store import Responses, Store

__all__ = ["Responses", "Store", "router"]
