"""llama.cpp's server dialect: ``POST /infill``, code completion as llama.vim and
llama.vscode send it (``_routes.py``), its body (``_schemas.py``) and its stopping rules
(``_rules.py``: ``n_indent``, ``t_max_predict_ms``)."""

from ._routes import router

__all__ = ["router"]
